"""bench/gpu_serve.py's seeded phase (``--seeded N``, our servers only): issue 13's "the same seed
gives the same text alone and among N concurrent streams", through the openai client."""

from __future__ import annotations

import asyncio

from gpu_e2e_model import make_prompts
from serve_measure import SEEDS


async def seeded_check(client, model: str, n: int, vocab: int, tokens: int) -> dict:
    """Issue 13's "the same seed gives the same text alone and among N streams": one sampled request
    (temperature 0.9, top-p 0.95, seed 1234) alone, then the same request among n - 1 others
    with other seeds and prompts, sent together; the token ids of the two answers compared."""
    async def one(prompt: list[int], seed: int) -> list[int]:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0.9,
                                            top_p=0.95, seed=seed, logprobs=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
        c = r.choices[0]
        ids = getattr(c, "token_ids", None)
        return list(ids) if ids is not None else list(c.logprobs.tokens)
    prompts = make_prompts(n, 32, vocab, SEEDS["seeded"])
    alone = await one(prompts[0], 1234)
    crowd = await asyncio.gather(*[one(p, 1234 if i == 0 else i) for i, p in enumerate(prompts)])
    first = next((i for i, (x, y) in enumerate(zip(alone, crowd[0], strict=False)) if x != y), None)
    return {"streams": n, "tokens": len(alone), "same": alone == crowd[0], "first_difference": first}


def seeded_line(r: dict) -> str:
    if r["same"]:
        return f"the same {r['tokens']} tokens alone and among {r['streams']} streams"
    return f"differs among {r['streams']} streams from token {r['first_difference']} of {r['tokens']}"
