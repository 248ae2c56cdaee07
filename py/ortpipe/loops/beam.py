"""Beam search over the same flow and caches, with the batch axis holding the beams.

The bookkeeping follows transformers' beam search: each step takes the best
max(2, 1 + len(eos)) * num_beams continuations over all beams (a kernel computes the log-softmax,
adds each beam's running score and takes the top k; the ids each beam's bans name, from
sampling/processors.py as greedy search bans them, at -inf after the log-softmax, as transformers' logits
processors set them); candidates that end (eos or max_length)
among the first num_beams enter the finished list with their score divided by
generated_length ** length_penalty; the best num_beams others run on, and the caches follow them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.settings import SearchSettings
from ..execute.flow import FlowRun
from ..execute.work import Backend, Handle, Run, Work, kernel
from ..plan import Plan
from ..sampling.processors import banned_ids
from ..sampling.sampler import forced_id

PENALTY = -1.0e9  # transformers' stand-in for "impossible"


@dataclass
class Hypothesis:
    tokens: list[int]  # generated ids
    score: float


class BeamSearch:
    def __init__(self, plan: Plan, backend: Backend, settings: SearchSettings, max_length: int,
                 eos: frozenset[int], inputs: dict[str, Handle] | None = None):
        self.plan, self.backend, self.settings = plan, backend, settings
        self.beams = settings.num_beams
        self.max_length, self.eos = max_length, eos
        self.flow = FlowRun(plan, backend, self.beams, max_length, inputs)
        gen = plan.generator
        self.kernel = kernel("beam_topk", plan.signatures[gen.session].output(gen.logits).dtype)
        self.keep = max(2, 1 + len(eos)) * self.beams

    def run(self, prompt: list[int]) -> Work:
        """The finished hypotheses, best first (num_return_sequences of them)."""
        beams = self.beams
        prompt = yield from self.flow.run_init(prompt)
        running = [Hypothesis([], 0.0)] + [Hypothesis([], PENALTY) for _ in range(beams - 1)]
        finished = [Hypothesis([], PENALTY) for _ in range(beams)]
        done_flags = [False] * beams
        cur_len, prompt_len = len(prompt), len(prompt)
        logits = yield from self.flow.run_iteration(prompt)
        improvable = True
        while True:
            forced = forced_id(self.settings, cur_len, self.max_length)
            if forced is not None:  # one candidate a beam, scored 0 as transformers' processors force it
                cands = sorted(((h.score, i, forced) for i, h in enumerate(running)), key=lambda c: -c[0])
            else:
                cands = yield from self._candidates(logits, prompt, running, cur_len - prompt_len)
            ends = [token in self.eos or cur_len + 1 >= self.max_length for _, _, token in cands]
            finished, done_flags = self._finish(
                cands, ends, running, finished, done_flags, cur_len - prompt_len + 1, improvable
            )
            order = sorted(range(len(cands)), key=lambda i: -(cands[i][0] + (PENALTY if ends[i] else 0.0)))[
                :beams
            ]
            sources = [cands[i][1] for i in order]
            running = [
                Hypothesis(
                    running[cands[i][1]].tokens + [cands[i][2]], cands[i][0] + (PENALTY if ends[i] else 0.0)
                )
                for i in order
            ]
            cur_len += 1
            improvable = improvable and self._improvable(running, finished, done_flags, cur_len - prompt_len)
            early_full = all(done_flags) and self.settings.early_stopping
            if not improvable or early_full or all(ends):
                break
            yield from self.flow.reorder(sources)
            logits = yield from self.flow.run_iteration([], [[h.tokens[-1]] for h in running])
        n = self.settings.num_return_sequences
        return [h for h, flag in zip(finished, done_flags, strict=True) if flag][:n] or running[:n]

    def _candidates(self, logits: Handle, prompt: list[int], running: list[Hypothesis],
                    generated: int) -> Work:
        """The best `keep` (score, beam, token) over all beams: running score plus the log-softmax, each
        beam's bans at -inf."""
        b, beams = self.backend, self.beams
        vocab = b.shape(logits)[-1]
        bans = [banned_ids(self.settings, prompt + h.tokens, generated, self.eos) for h in running]
        width = max(1, max(len(row) for row in bans))
        out = yield Run(
            self.kernel,
            {
                "logits": logits,
                "running": b.tensor([h.score for h in running], (beams,), "float32"),
                "banned": b.tensor([i for row in bans for i in row + [vocab] * (width - len(row))],
                                   (beams, width), "int64"),
                "renormalize": b.tensor([self.settings.renormalize_logits], (1,), "bool"),
                "k": b.tensor([self.keep], (1,), "int64"),
            },
            ("values", "indices"),
        )
        return [(score, index // vocab, index % vocab)
                for score, index in zip(b.to_list(out["values"]), b.to_list(out["indices"]), strict=True)]

    def _finish(
        self,
        cands: list[tuple[float, int, int]],
        ends: list[bool],
        running: list[Hypothesis],
        finished: list[Hypothesis],
        flags: list[bool],
        generated: int,
        improvable: bool,
    ) -> tuple[list[Hypothesis], list[bool]]:
        full = all(flags) and self.settings.early_stopping
        merged = list(zip(finished, flags, strict=True))
        for i, (score, beam, token) in enumerate(cands):
            top = i < self.beams
            just_done = ends[i] and top
            normalized = score / (generated**self.settings.length_penalty)
            normalized += (PENALTY if full else 0.0) + (0.0 if improvable else PENALTY)
            normalized += 0.0 if just_done else PENALTY
            merged.append((Hypothesis(running[beam].tokens + [token], normalized), just_done))
        best = sorted(range(len(merged)), key=lambda i: -merged[i][0].score)[: self.beams]
        return [merged[i][0] for i in best], [merged[i][1] for i in best]

    def _improvable(
        self, running: list[Hypothesis], finished: list[Hypothesis], flags: list[bool], generated: int
    ) -> bool:
        best_running = max(h.score for h in running) / (generated**self.settings.length_penalty)
        worst_finished = min(h.score for h in finished) if all(flags) else PENALTY
        return best_running > worst_finished
