"""The serving loop's request trace (`kvledger bench sglang --part serving`), `lognormal-chat`.

Poisson arrivals at `rate` requests per step (arrivals counted in steps, not seconds, so
every variant runs the same batches step by step and generates the same tokens); prompt and
output lengths log-normal (median `prompt_median`, sigma `prompt_sigma`; median
`output_median`, sigma `output_sigma`), clipped; with probability `prefix_share` a request
starts with one of `prefix_groups` shared prefixes of `prefix_pages` x 1..groups pages
(page-aligned, as SGLang's radix matches are; held for the whole trace by a request standing
in for the radix cache, so the sharer allocates only its own tokens and protects the prefix:
`cache_protected_len`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvledger.tools.bench.sglang_engine import PAGE

TRACE_NAME = "lognormal-chat"


@dataclass(frozen=True)
class TraceSpec:
    """`lognormal-chat`: see the module docstring. Lengths in tokens, `rate` in arrivals per
    scheduler step."""

    steps: int
    rate: float = 0.3
    prompt_median: float = 1024.0
    prompt_sigma: float = 1.0
    prompt_min: int = 32
    prompt_max: int = 8192
    output_median: float = 128.0
    output_sigma: float = 0.8
    output_min: int = 4
    output_max: int = 1024
    prefix_share: float = 0.5
    prefix_groups: int = 4
    prefix_pages: int = 2
    seed: int = 13

    def describe(self) -> str:
        return (
            f"{TRACE_NAME}: Poisson arrivals, {self.rate:g} a step; prompt log-normal "
            f"(median {self.prompt_median:g}, sigma {self.prompt_sigma:g}, "
            f"{self.prompt_min}..{self.prompt_max}); output log-normal (median "
            f"{self.output_median:g}, sigma {self.output_sigma:g}, {self.output_min}.."
            f"{self.output_max}); {self.prefix_share:.0%} share one of {self.prefix_groups} "
            f"prefixes of {self.prefix_pages}..{self.prefix_pages * self.prefix_groups} pages; "
            f"seed {self.seed}"
        )


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival: int  # the step it arrives at
    prompt: int  # tokens, the shared prefix included
    output: int
    group: int  # the shared prefix (-1: none)


def prefix_tokens(spec: TraceSpec, group: int) -> int:
    return (group + 1) * spec.prefix_pages * PAGE


def make_trace(spec: TraceSpec) -> list[TraceRequest]:
    """The requests arriving over `spec.steps` steps, in arrival order (same seed, same trace)."""
    rng = random.Random(spec.seed)
    out: list[TraceRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(spec.rate)
        if t >= spec.steps:
            return out
        group = -1
        if rng.random() < spec.prefix_share:
            group = rng.randrange(spec.prefix_groups)
        own = rng.lognormvariate(math.log(spec.prompt_median), spec.prompt_sigma)
        own = min(spec.prompt_max, max(spec.prompt_min, round(own)))
        prompt = own + (prefix_tokens(spec, group) if group >= 0 else 0)
        output = rng.lognormvariate(math.log(spec.output_median), spec.output_sigma)
        output = min(spec.output_max, max(spec.output_min, round(output)))
        out.append(TraceRequest(len(out), int(t), prompt, output, group))
