"""Rendering a validate Report: Rich (grouped by severity, then code) and JUnit XML for CI."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict

from rich.console import Console
from rich.markup import escape

from exl3tools.text import for_console
from exl3tools.validate.findings import MAX_PER_CODE, Finding, Report
from exl3tools.validate.rules import RULES

SHOW_PER_CODE = 20


def render(report: Report, console: Console, *, strict: bool = False, show: int = SHOW_PER_CODE) -> None:
    s = report.stats
    head = f"[bold]{for_console(report.path)}[/]"
    if s.get("architecture"):
        head += f"  {for_console(s['architecture'])}"
    bits = [f"{s[k]} {k}" for k in ("files", "tensors", "linears") if k in s]
    if "decoded_blocks" in s:
        bits.append(f"{s['decoded_blocks']} sampled blocks decoded")
    if "decoded_linears" in s:
        bits.append(f"{s['decoded_linears']} linears decoded")
    if "bytes_read" in s:
        bits.append(f"{s['bytes_read'] / 1e6:.1f} MB read")
    if "seconds" in s:
        bits.append(f"{s['seconds']:.2f} s")
    console.print(head)
    console.print(f"[dim]{s.get('mode', '')} check: {', '.join(bits)}[/]")
    for sev, color in (("error", "red"), ("warning", "yellow")):
        items = [f for f in report.findings if f.severity == sev]
        if not items:
            continue
        console.print(f"\n[bold {color}]{len(items)} {sev}{'s' if len(items) != 1 else ''}[/]")
        by_code: dict[str, list[Finding]] = defaultdict(list)
        for f in items:
            by_code[f.code].append(f)
        for code in sorted(by_code):
            fs = by_code[code]
            console.print(f"  [bold {color}]{code}[/] {escape(RULES[code].title)} [dim]({len(fs)})[/]")
            for f in fs[:show]:
                where = ":".join(x for x in (f.file, f.tensor) if x)
                console.print(f"    {for_console(where)}{': ' if where else ''}{for_console(f.message)}", soft_wrap=True)
            if len(fs) > show:
                console.print(f"    [dim]... and {len(fs) - show} more (--json lists up to {MAX_PER_CODE:,} per rule)[/]")
    if "sha256" in s:
        console.print("\n[dim]sha256:[/]")
        for name, h in s["sha256"].items():
            console.print(f"  {h}  {for_console(name)}", soft_wrap=True)
    n_e, n_w = len(report.errors), len(report.warnings)
    if report.ok(strict):
        verdict = "[bold green]OK[/]" + (f" ({n_w} warning{'s' if n_w != 1 else ''})" if n_w else "")
    else:
        why = f"{n_e} error{'s' if n_e != 1 else ''}" if n_e else f"{n_w} warning(s) with --strict"
        verdict = f"[bold red]FAILED[/]: {why}" + (f", {n_w} warning(s)" if n_e and n_w else "")
    console.print(f"\n{verdict}")


def junit_xml(report: Report, *, strict: bool = False) -> bytes:
    """One testsuite; one testcase per rule (passing when it has no findings), failures per finding."""
    by_code: dict[str, list[Finding]] = defaultdict(list)
    for f in report.findings:
        by_code[f.code].append(f)
    failing = [c for c in by_code if RULES[c].severity == "error" or strict]
    suite = ET.Element("testsuite", name=f"exl3tools validate {report.path}", tests=str(len(RULES)),
                       failures=str(len(failing)), errors="0", skipped="0",
                       time=str(report.stats.get("seconds", 0)))
    for code, rule in RULES.items():
        case = ET.SubElement(suite, "testcase", classname=f"validate.{rule.group.replace(' ', '_')}",
                             name=f"{code} {rule.title}")
        fs = by_code.get(code, [])
        if not fs:
            continue
        text = "\n".join(f.line for f in fs)
        if code in failing:
            el = ET.SubElement(case, "failure", message=f"{len(fs)} finding(s): {fs[0].line}"[:500],
                               type=rule.severity)
            el.text = text
        else:
            ET.SubElement(case, "system-out").text = text
    root = ET.Element("testsuites", name="exl3tools validate", tests=str(len(RULES)), failures=str(len(failing)))
    root.append(suite)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)
