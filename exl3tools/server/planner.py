"""What one engine step computes: a token for every decoding sequence and prompt chunks within the
step's token budget, kept within the prompt graphs where a step can replay one (server/engine.py)."""

from __future__ import annotations

from exl3tools.server.requests import Sequence

# a prompt whose logprobs are wanted (completions' echo) is cut into chunks of at most this many
# rows: its steps return every row's logits (rows x vocabulary float32: 154k x 128 x 4 B = 79 MB)
SCORED_CHUNK = 128


def _decoding(seq: Sequence) -> bool:
    return seq.pending == 1 and bool(seq.output_ids)


def graph_limits(runner) -> tuple[int, int] | None:
    """The runner's prompt-graph limits (``Runner.prompt_graph_limits``), None where it has none."""
    fn = getattr(runner, "prompt_graph_limits", None)
    return fn() if fn is not None else None


def plan_step(running: list[Sequence], budget: int,
              graph_limits: tuple[int, int] | None = None) -> list[tuple[Sequence, list[int]]]:
    """This step's tokens for ``running`` (in order): one per decoding sequence, prefill chunks
    within ``budget`` prompt tokens.

    ``graph_limits`` (rows, context reads: ``Runner.prompt_graph_limits``; None: no prompt fit): a
    step that would replay a prompt graph takes no further prompt whose chunk would push it past
    those rows or reads into the eager forward, whose fixed cost stalls every running stream; that
    prompt leads the next step's prompts instead (a burst of 32 streams on the H200: one 869-row
    eager step of 52 ms became graphs of 16 and 17 ms). The first prompt of a step is always
    taken, so a long one still goes eager in the budget's chunks."""
    batch: list[tuple[Sequence, list[int]]] = []
    rows = sum(1 for seq in running if _decoding(seq))
    reads = prompts = 0
    for seq in running:
        if _decoding(seq):
            batch.append((seq, [seq.output_ids[-1]]))
        elif budget > 0:
            chunk = seq.next_chunk(min(budget, SCORED_CHUNK) if seq.scores_prompt else budget)
            if graph_limits is not None:
                max_rows, max_reads = graph_limits
                r = len(chunk)
                rd = r * (seq.num_cached + r) if r > 1 else 0
                fits_before = rows <= max_rows and reads <= max_reads
                if prompts and fits_before and (rows + r > max_rows or reads + rd > max_reads):
                    continue
                rows, reads, prompts = rows + r, reads + rd, prompts + 1
            budget -= len(chunk)
            batch.append((seq, chunk))
    return batch
