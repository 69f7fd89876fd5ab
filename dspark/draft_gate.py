"""Whether drafting pays at all: the decision Algorithm 1 cannot make.

Algorithm 1 prices verification, and rightly treats the draft as already paid for: by the
time it runs, it is. But a drafter that costs a large share of a target step (a neural
drafter on a CPU) and whose drafts are mostly rejected makes every round slower than a
plain one. The gate watches what drafting rounds actually deliver and skips drafting, for
the whole batch, while a plain round would clearly be faster:

    skip   iff   (1 + gain) / t_draft  <  min_speedup / t_plain

gain     accepted draft tokens per row per drafting round (moving average)
t_draft  a drafting round's wall time (draft + verify + accept), moving average
t_plain  a round without a draft, moving average seeded by the cost table (the first plain
         round is left out: it pays one-off warm-up costs)

Times are divided by the cost table's one-token latency for that many rows, so rounds with
different batch sizes compare. A "skip" lasts 1, 2, 4 ... (at most `max_skip`) rounds, after
which one drafting round probes again; a probe that pays resets the pause. A probe is judged on
its own: its round replaces the averages instead of joining them, since those describe the text
before the pause. Blended in at `alpha`, one paying probe could not lift averages dragged down by
a hard stretch, and the pauses would keep doubling through text the drafter does well on.

A drafter that costs almost nothing (`cheap`: under 5% of a plain round, e.g. n-gram lookup)
is never gated: its value comes in bursts (a copied phrase) that the scheduler already picks
out round by round from the confidences, for free, and an average over rounds would miss them.

Lossless: the decision reads past rounds only, so it never depends on what the target will say.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


@dataclass
class DraftGate:
    plain_latency: Callable[[int], float]  # seconds of a one-token-per-row round for R rows
    alpha: float = 0.1
    max_skip: int = 32
    min_speedup: float = 0.95  # hysteresis: round times are noisy, and skipping forgoes bursts
    cheap: float = 0.05  # drafter calls under this share of a plain round are never gated
    gain: float | None = None
    t_draft: float | None = None  # normalised by plain_latency(R)
    t_plain: float | None = None  # normalised likewise; None: trust the cost table (1.0)
    t_propose: float | None = None  # the drafter call alone, normalised likewise
    plain_rounds: int = 0  # plain rounds recorded (the first is left out of t_plain: warm-up)
    skip_left: int = 0
    next_skip: int = 1
    probing: bool = False  # the next drafting round ends a pause

    @property
    def plain(self) -> float:
        """A plain round's normalised time: measured, or the cost table's word (1.0) until then."""
        return 1.0 if self.t_plain is None else self.t_plain

    def expected_speedup(self) -> float | None:
        """Tokens/s of a drafting round over a plain one, from the averages (None: no data)."""
        if self.gain is None or self.t_draft is None:
            return None
        return (1.0 + self.gain) * self.plain / self.t_draft

    def should_draft(self) -> bool:
        if self.skip_left > 0:
            self.skip_left -= 1
            self.probing = True
            return False
        return True

    def record(self, rows: int, seconds: float, emitted: int, drafted: bool, propose_s: float) -> None:
        """One finished round: `rows` in the batch, its wall time, tokens it emitted in all,
        whether any row had a draft (a round with no draft at all is a plain round), and the
        seconds of that wall time spent in the drafter call."""
        if rows <= 0:
            return
        unit = self.plain_latency(rows)
        if not drafted:
            # Plain rounds come only from pauses, so they are few, and the first one pays one-off
            # costs (kernels' packed weights built on first call). Taken as the yardstick it would
            # make every draft look cheaper than it is, so that drafting is never paused again.
            # So the first is left out and the rest move the table's word at alpha.
            if self.plain_rounds > 0:
                self.t_plain = _ewma(self.plain, seconds / unit, self.alpha)
            self.plain_rounds += 1
            return
        alpha = 1.0 if self.probing else self.alpha
        self.probing = False
        self.gain = _ewma(self.gain, emitted / rows - 1.0, alpha)
        self.t_draft = _ewma(self.t_draft, seconds / unit, alpha)
        self.t_propose = _ewma(self.t_propose, propose_s / unit, alpha)
        speedup = self.expected_speedup()
        if speedup is not None and speedup < self.min_speedup and self.t_propose >= self.cheap * self.plain:
            self.skip_left = self.next_skip
            self.next_skip = min(2 * self.next_skip, self.max_skip)
        else:
            self.next_skip = 1


def gate_for(scheduler) -> DraftGate | None:
    """A fresh gate for a scheduler that asks for one and prices rounds with a cost table."""
    cost = getattr(scheduler, "cost", None)
    return DraftGate(cost.plain_latency) if getattr(scheduler, "gates_drafting", False) and cost is not None else None
