"""bench/gpu_all.sh, the one script every device call runs, on the CPU: its bash parses, the
wait for exllamav3's detached build returns at once where no build was started (with
EXL3_BUILD=0 and a carried .exl3so it once waited for a build log until the call's timeout and
spent the rest of a session's device time), and the mla stage serves MTP configs on the shapes
with an MTP head."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_all.sh"


def _bash():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("needs bash")
    return bash


@pytest.mark.parametrize("script", sorted(SCRIPT.parent.glob("*.sh")), ids=lambda p: p.name)
def test_the_bench_scripts_parse(script):
    r = subprocess.run([_bash(), "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_each_stage_is_matched_as_a_whole_word():
    """A stage runs when its name is one of the arguments, not a part of one: `absorb` once ran the
    ab stage too, which stopped the call for want of AB_VAR (2026-12-07 13:23)."""
    import re

    text = SCRIPT.read_text()
    conds = re.findall(r'"? ?\$STAGES ?"? == (?:\*" [^"]*"\*|[^\s\]]+)', text)
    assert len(conds) >= 20
    stages = [re.fullmatch(r'" \$STAGES " == \*" ([a-z0-9]+) "\*', c) for c in conds]
    assert all(stages), [c for c, m in zip(conds, stages, strict=True) if not m]
    names = {m.group(1) for m in stages}
    assert {"ab", "absorb", "tests", "serve", "mla"} <= names
    r = subprocess.run([_bash(), "-c", 'STAGES="absorb"; [[ " $STAGES " == *" ab "* ]] && echo ab; '
                                       '[[ " $STAGES " == *" absorb "* ]] && echo absorb'],
                       capture_output=True, text=True, timeout=30)
    assert r.stdout.split() == ["absorb"], r.stdout


def _function(name: str) -> str:
    """The text of gpu_all.sh's top-level bash function ``name``."""
    text = SCRIPT.read_text()
    body = text[text.index(f"\n{name}() {{") + 1:]          # at a line's start: pack_cubins is in unpack_cubins
    return body[:body.index("\n}\n") + 3]


def _wait_build(tmp_path: Path, log: str | None, seconds: str = "") -> tuple[int, float]:
    """Run gpu_all.sh's wait_build alone, its build log at a private path (None: no log)."""
    body = _function("wait_build").replace("/tmp/exl3build.log", str(tmp_path / "exl3build.log"))
    if log is not None:
        (tmp_path / "exl3build.log").write_text(log)
    # a file, not bash -c: pgrep -f would find the marker in this shell's own command line (it finds
    # none here unless a real build runs on this machine)
    script = tmp_path / "wait.sh"
    script.write_text(f"L={tmp_path}\n{body}\nwait_build {seconds}\n")
    t = time.monotonic()
    r = subprocess.run([_bash(), str(script)], capture_output=True, text=True, timeout=60)
    return r.returncode, time.monotonic() - t


def test_wait_build_returns_at_once_without_a_build(tmp_path):
    rc, took = _wait_build(tmp_path, None)
    assert rc == 0 and took < 5


def test_wait_build_waits_for_a_started_build(tmp_path):
    rc, _ = _wait_build(tmp_path, "exllamav3 ok\nbuild rc 0\n")          # ended: copied to $L
    assert rc == 0 and (tmp_path / "build.log").read_text().endswith("build rc 0\n")
    rc, took = _wait_build(tmp_path, "compiling\n", "2")                # running: waits, then rc 1
    assert rc == 1 and took >= 1.5


def _spec_configs(arch: str, variants: str = "graphs", spec: str | None = None) -> list[str]:
    """The --config arguments gpu_all.sh's mla stage adds for ``arch``'s MTP (MLA_SPEC: ``spec``)."""
    env = "unset MLA_SPEC" if spec is None else f"MLA_SPEC='{spec}'"
    script = f"{_function('mla_spec_configs')}\n{env}; CFG=(); mla_spec_configs {arch} '{variants}'\n" \
             'for x in "${CFG[@]}"; do echo "$x"; done'
    r = subprocess.run([_bash(), "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize("arch", ["glm5", "glm5_flat", "deepseek_v3", "deepseek_v3_flat"])
def test_mla_serves_mtp_configs_on_the_shapes_with_an_mtp_head(arch):
    """MLA_SPEC (default 1 2 3) on every MLA shape with an MTP head, the eager-head opt-out with
    the mtp_paged variant; MLA_SPEC empty: none."""
    assert _spec_configs(arch) == [x for k in (1, 2, 3) for x in
                                   ("--config", f"{arch}_mtp{k}:--max-model-len 32768 --speculative-tokens {k}")]
    paged = _spec_configs(arch, "graphs mtp_paged", "2")
    assert paged[3] == f"{arch}_mtp2_eager_head:EXL3TOOLS_MTP_PAGED=0 --max-model-len 32768 --speculative-tokens 2"
    assert len(paged) == 4 and _spec_configs(arch, spec="") == []


def test_mla_serves_no_mtp_config_without_an_mtp_head():
    assert _spec_configs("glm4_moe") == []


def _stage_runs(tmp_path: Path, echo: str, function: str, call: str) -> list[str]:
    """gpu_all.sh's stage ``function`` run by ``call`` with logs under tmp_path and a fake python3
    that prints ``echo`` (shell words) and "->": the lines the stage shows from its bench logs."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(f'#!/bin/sh\necho "{echo} ->"\n')
    (fake / "python3").chmod(0o755)
    script = f"L={tmp_path}; T0=0; el() {{ echo \"$*\"; }}\n{_function('side_runs')}\n{_function(function)}\n{call}\n"
    r = subprocess.run([_bash(), "-c", script], capture_output=True, text=True, timeout=30,
                       env={"PATH": f"{fake}:/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return [ln for ln in r.stdout.splitlines() if ln.endswith("->")]


def test_ab_runs_the_bench_off_on_on_off(tmp_path):
    """The ab stage (ab_runs): the linear bench with the switch 0, 1, 1, 0, each a process of its own
    with the switch in its environment and the bench's arguments as given, each log kept apart."""
    runs = _stage_runs(tmp_path, "$0 $* switch=$EXL3TOOLS_X", "ab_runs", "ab_runs EXL3TOOLS_X --impls cuda --rows 1,8")
    assert [ln.split("switch=")[1] for ln in runs] == ["0 ->", "1 ->", "1 ->", "0 ->"], runs
    assert all("bench/gpu_bench.py --graph --impls cuda --rows 1,8 " in ln for ln in runs), runs
    assert sorted(p.name for p in tmp_path.glob("ab_*.log")) == ["ab_1.log", "ab_2.log", "ab_3.log", "ab_4.log"]


def test_defs_runs_each_define_set_between_two_default_builds(tmp_path):
    """The defs stage (defs_runs): the default build, each ';'-separated set whole (spaces kept) as
    EXL3TOOLS_GEMV_DEFINES, the default again; each set's cubins built before its bench run."""
    runs = _stage_runs(tmp_path, "$0 $1 defs=[$EXL3TOOLS_GEMV_DEFINES]", "defs_runs",
                       "defs_runs '-DXDUP_SMEM=1;-DPRO_P=2 -DPRO_MINB=9' --impls cuda_pro --rows 1")
    assert [ln.split("defs=")[1] for ln in runs] == ["[] ->", "[-DXDUP_SMEM=1] ->", "[-DPRO_P=2 -DPRO_MINB=9] ->",
                                                     "[] ->"], runs
    builds = [(tmp_path / f"defs_{i}_build.log").read_text() for i in range(1, 5)]
    assert all(" -c " in b for b in builds), builds
    assert "defs=[-DPRO_P=2 -DPRO_MINB=9]" in builds[2], builds


@pytest.mark.parametrize("synth_args,folder", [(None, "/tmp/air6"), ("--codebook mcg", "/tmp/air6___codebook_mcg")])
def test_the_synthetic_checkpoint_has_a_folder_per_synth_args(synth_args, folder):
    """A warm machine's /tmp/air6 built with other SYNTH_ARGS (another codebook) is not reused."""
    line = next(ln for ln in SCRIPT.read_text().splitlines() if ln.startswith("AIR="))
    env = "unset SYNTH_ARGS" if synth_args is None else f"SYNTH_ARGS='{synth_args}'"
    r = subprocess.run([_bash(), "-c", f"{env}; {line}; echo $AIR"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == folder, r.stderr


def _run_tests(tmp_path, calls: str) -> list[str]:
    """gpu_all.sh's run_tests function alone, its python3 and timeout faked (each python3 call a line
    of its arguments, its EXL3TOOLS_GEMV_DEFINES and any $paths it sees), ``calls`` after it."""
    text = SCRIPT.read_text()
    body = text[text.index("  run_tests() {"):]
    body = body[:body.index("\n  }\n") + 5]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(f'#!/bin/sh\necho "$* defs=[$EXL3TOOLS_GEMV_DEFINES] p=[$paths]" >> {tmp_path}/calls\n')
    (fake / "python3").chmod(0o755)
    (fake / "timeout").write_text('#!/bin/sh\nshift\nexec "$@"\n')
    (fake / "timeout").chmod(0o755)
    script = f"L={tmp_path}; NT=1; T0=0; el() {{ echo \"$*\"; }}\n{body}\n{calls}\n"
    r = subprocess.run([_bash(), "-c", script], capture_output=True, text=True, timeout=30,
                       env={"PATH": f"{fake}:/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return (tmp_path / "calls").read_text().splitlines()


def test_each_test_run_builds_its_own_cubins_first(tmp_path):
    """The tests stage (run_tests): an entry's cubins (its build defines in its environment) are
    built once before its pytest starts, not by every worker at once."""
    calls = _run_tests(tmp_path, "run_tests _0 EXL3TOOLS_GEMV_DEFINES=-DXDUP_SMEM=1")
    assert [c.split()[:2] for c in calls] == [["-m", "exl3tools.kernels.cuda_build"], ["-m", "pytest"]], calls
    assert all(c.endswith("defs=[-DXDUP_SMEM=1] p=[]") for c in calls), calls


def test_a_test_entry_with_paths_runs_only_those_files(tmp_path):
    """TEST_ENVS's "paths=a.py,b.py" token: that entry's pytest gets those files (not the full
    suite), the token is no environment variable, and an entry without one keeps TEST_PATHS."""
    calls = _run_tests(tmp_path, "run_tests _1 'paths=tests/gpu/a.py,tests/gpu/b.py EXL3TOOLS_GEMV_DEFINES=-DX=1'\n"
                                 "run_tests _0 ''")
    pytests = [c for c in calls if c.startswith("-m pytest")]
    assert len(pytests) == 2, pytests
    assert " tests/gpu/a.py tests/gpu/b.py " in pytests[0] and "tests/gpu " not in pytests[0], pytests[0]
    assert pytests[0].endswith("defs=[-DX=1] p=[]"), pytests[0]     # (paths= is no variable of the run)
    assert " tests/gpu tests/test_cuda_bit_logic.py " in pytests[1] and "a.py" not in pytests[1], pytests[1]


def test_a_cut_test_run_lists_the_tests_it_left(tmp_path):
    """run_tests cut by TEST_TIMEOUT (rc 124): the collected node ids less those tests/conftest.py
    wrote to tests_live.log.done go to tests_unrun.txt (the next call's TEST_PATHS); a run that
    ends by itself writes none."""
    text = SCRIPT.read_text()
    body = text[text.index("  run_tests() {"):]
    body = body[:body.index("\n  }\n") + 5]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(
        '#!/bin/sh\ncase "$*" in\n'
        '  *--collect-only*) printf "tests/gpu/a.py::t1\\ntests/gpu/a.py::t2[x-1]\\ntests/gpu/b.py::t3\\n3 tests\\n" ;;\n'
        '  *"-m pytest"*) printf "tests/gpu/a.py::t1\\ntests/gpu/b.py::t3\\n" > "$EXL3TOOLS_TEST_LOG.done"; exit $RC ;;\n'
        'esac\n')
    (fake / "python3").chmod(0o755)
    (fake / "timeout").write_text('#!/bin/sh\nshift\nexec "$@"\n')
    (fake / "timeout").chmod(0o755)
    for rc, want in (("124", ["tests/gpu/a.py::t2[x-1]"]), ("0", None)):
        out = tmp_path / f"rc{rc}"
        out.mkdir()
        script = f"L={out}; NT=1; T0=0; el() {{ echo \"$*\"; }}\n{body}\nrun_tests '' ''\n"
        r = subprocess.run([_bash(), "-c", script], capture_output=True, text=True, timeout=30,
                           env={"PATH": f"{fake}:/usr/bin:/bin", "RC": rc})
        assert r.returncode == 0, r.stderr
        unrun = out / "tests_unrun.txt"
        if want is None:
            assert not unrun.exists(), r.stdout
        else:
            assert unrun.read_text().splitlines() == want and "1 of 3 not run" in r.stdout, r.stdout


def test_the_test_log_lists_each_finished_test(tmp_path):
    """tests/conftest.py with EXL3TOOLS_TEST_LOG: each finished test's node id in <log>.done (what
    run_tests subtracts from the collection when a run is cut)."""
    import os
    import sys

    node = "tests/test_gpu_all_script.py::test_wait_build_returns_at_once_without_a_build"
    log = tmp_path / "live.log"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
                       cwd=SCRIPT.parent.parent, capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
                            "EXL3TOOLS_TEST_LOG": str(log)})     # (a worker's variables: the child is no worker)
    assert r.returncode == 0, r.stdout[-2000:]
    assert Path(f"{log}.done").read_text().splitlines() == [node]


def test_cubins_travel_packed_and_go_back_only_when_built(tmp_path):
    """unpack_cubins / pack_cubins: a call packs its cubin cache to $OUT/cudacache.txz when its
    build added cubins (not otherwise: a call that built nothing sends nothing back), and a later
    call carrying that file as .cudacache.txz finds every cubin in place before its build (a fresh
    machine spent ~50 s of device time building all 28)."""
    if shutil.which("xz") is None or shutil.which("tar") is None:
        pytest.skip("needs xz and tar")
    funcs = "\n".join(_function(f) for f in ("unpack_cubins", "cubin_list", "pack_cubins"))

    def call(work: Path, out: Path, build: list[str], names: list[str] | None = None) -> str:
        """A call whose build writes ``build`` and names ``names`` (None: what it wrote) as its set."""
        out.mkdir(parents=True)
        cache = work / ".cudacache"
        fake_build = "; ".join(f"echo {n} > {cache}/{n}" for n in build) or ":"
        (out / "names.txt").write_text("".join(f"{n}\n" for n in (build if names is None else names)))
        script = (f"set -u\ncd {work}\nOUT={out}\nEXL3TOOLS_CUDA_CACHE={cache}\n{funcs}\n"
                  f"unpack_cubins; BEFORE=$(cubin_list)\nmkdir -p {cache}; {fake_build}\n"
                  f'pack_cubins "$BEFORE" {out}/names.txt\ncubin_list\n')
        r = subprocess.run([_bash(), "-c", script], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    assert call(first, tmp_path / "out1", ["a_1.cubin", "b_2.cubin", "b_2.cubin.lock"],
                ["a_1.cubin", "b_2.cubin"]).split() == ["a_1.cubin", "b_2.cubin"]
    packed = tmp_path / "out1" / "cudacache.txz"
    assert packed.is_file() and not (tmp_path / "out1" / "cudacache.txz.tmp").exists()
    second.mkdir()
    shutil.copy(packed, second / ".cudacache.txz")                      # carried by the next call
    assert call(second, tmp_path / "out2", []).split() == ["a_1.cubin", "b_2.cubin"]
    assert not (tmp_path / "out2" / "cudacache.txz").exists()            # nothing built, nothing back
    assert (second / ".cudacache" / "a_1.cubin").read_text() == "a_1.cubin\n"
    assert not (second / ".cudacache" / "b_2.cubin.lock").exists()
    # a source changed: c_3 replaces b_2 in the build's set, and b_2 (stale) does not go back
    assert call(second, tmp_path / "out3", ["c_3.cubin"], ["a_1.cubin", "c_3.cubin"]).split() == \
        ["a_1.cubin", "b_2.cubin", "c_3.cubin"]
    third = tmp_path / "third"
    third.mkdir()
    shutil.copy(tmp_path / "out3" / "cudacache.txz", third / ".cudacache.txz")
    assert call(third, tmp_path / "out4", []).split() == ["a_1.cubin", "c_3.cubin"]


def test_a_cut_call_still_tars_its_logs(tmp_path):
    """TERM from the call's own `timeout` (to the whole group, the stage's command included): the
    logs still go back as one logs.tgz, not file by file (a call returns a limited number of files)."""
    if shutil.which("timeout") is None:
        pytest.skip("needs coreutils timeout")
    funcs = "\n".join(_function(f) for f in ("tar_logs", "on_term"))
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    for i in range(3):
        (out / "logs" / f"stage{i}.log").write_text(f"stage {i}\n")
    script = tmp_path / "cut.sh"
    script.write_text(f"set -u\nOUT={out}\nL=$OUT/logs\nT0=$(date +%s)\nel() {{ echo \"$*\"; }}\n{funcs}\n"
                      "trap on_term TERM\nsleep 30\necho not cut\n")
    t = time.monotonic()
    r = subprocess.run(["timeout", "2", _bash(), str(script)], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t < 20 and "not cut" not in r.stdout, r.stdout
    assert r.returncode == 124 and "cut (TERM)" in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert not (out / "logs").exists()
    import tarfile
    with tarfile.open(out / "logs.tgz") as tf:
        assert sorted(tf.getnames()) == ["logs", "logs/stage0.log", "logs/stage1.log", "logs/stage2.log"]
