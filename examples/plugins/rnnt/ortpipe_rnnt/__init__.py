"""An ortpipe plugin: greedy decoding of an RNN transducer (RNNT), the case the design document gives
for plugins: a loop over encoder frames with an inner loop of symbols per frame, which the config's
vocabulary (init, step, final) cannot say.

Three graphs, named in the folder's `pipeline.sessions`:
- `encoder`: features [1, frames, F] -> encoder_out [1, frames, D]
- `predictor`: token [1, 1] (int64), state [1, H] -> prediction [1, 1, D], state_out [1, H]
- `joiner`: encoder_frame [1, 1, D], prediction [1, 1, D] -> logits [1, 1, V]

Greedy transducer decoding: the predictor first reads the blank (id 0) and then the prompt's ids;
for every encoder frame, the joiner's most likely symbol is emitted and fed to the predictor, until
the joiner gives the blank (next frame) or `MAX_SYMBOLS` symbols were emitted for the frame. The loop
yields ortpipe's work items only (sessions, and its `narrow` and `argmax_last` kernels), so ortpipe
runs it the same way under CPython and in the browser.

    {"version": 2, "pipeline": {"sessions": {"encoder": {"file": "encoder.onnx"}, ...},
                                "plugin": {"module": "ortpipe_rnnt:factory",
                                           "wheel": "ortpipe_rnnt-0.1.0-py3-none-any.whl"}}}
"""

from __future__ import annotations

from typing import Any

from ortpipe.execute.work import Run, kernel

BLANK = 0
MAX_SYMBOLS = 4  # per encoder frame


def factory(context: Any) -> Transducer:
    return Transducer(context)


factory.settings = ()  # greedy decoding reads no generation settings: ortpipe refuses a request that sets one



class Transducer:
    def __init__(self, context: Any):
        self.ctx = context
        if "features" not in context.inputs:
            from ortpipe.errors import GenerationError

            raise GenerationError('this transducer needs its input "features" [1, frames, F] '
                                  '(inputs={"features": ...})')
        state = context.plan.signatures["predictor"].input("state")
        self.state_size = state.shape[1]

    def run(self, prompt: list[int]) -> Any:
        b = self.ctx.backend
        room = self.ctx.max_length - len(prompt)
        out = yield Run("encoder", {"features": self.ctx.inputs["features"]}, ("encoder_out",))
        encoded = out["encoder_out"]
        frames = b.shape(encoded)[1]
        state = b.full((1, self.state_size), 0.0, "float32")
        prediction = None
        for token in [BLANK, *prompt]:
            prediction, state = yield from self._predict(token, state)
        tokens: list[int] = []
        for t in range(frames):
            frame = yield from self._frame(encoded, t)
            for _ in range(MAX_SYMBOLS):
                out = yield Run("joiner", {"encoder_frame": frame, "prediction": prediction}, ("logits",))
                out = yield Run(kernel("argmax_last", "float32"), {"logits": out["logits"]}, ("token",))
                symbol = b.to_list(out["token"])[0]
                if symbol == BLANK:
                    break
                tokens.append(symbol)
                if len(tokens) >= room or symbol in self.ctx.eos:
                    return tokens
                prediction, state = yield from self._predict(symbol, state)
        return tokens

    def _predict(self, token: int, state: Any) -> Any:
        ids = self.ctx.backend.tensor([token], (1, 1), "int64")
        out = yield Run("predictor", {"token": ids, "state": state}, ("prediction", "state_out"))
        return out["prediction"], out["state_out"]

    def _frame(self, encoded: Any, t: int) -> Any:
        b = self.ctx.backend
        out = yield Run(kernel("narrow", "float32"), {
            "x": encoded, "start": b.tensor([t], (1,), "int64"), "end": b.tensor([t + 1], (1,), "int64"),
            "axis": b.tensor([1], (1,), "int64")}, ("y",))
        return out["y"]
