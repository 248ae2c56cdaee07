"""The sans-IO executor driven by scripted outputs: what it asks for, step by step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ortpipe.config import load_config
from ortpipe.errors import GenerationError
from ortpipe.execute.work import Decode, Decoded, Run
from ortpipe.folder import LocalFolder
from ortpipe.loops.autoregressive import Limits, TokenGenerator
from ortpipe.plan import make_plan
from ortpipe.signature import Signature, TensorInfo


class FakeTensor:
    def __init__(self, values: list, shape: tuple[int, ...], dtype: str):
        self.values, self.shape, self.dtype = list(values), tuple(shape), dtype


class FakeBackend:
    def tensor(self, values, shape, dtype):
        return FakeTensor(values, shape, dtype)

    def full(self, shape, value, dtype):
        n = 1
        for d in shape:
            n *= d
        return FakeTensor([value] * n, shape, dtype)

    def shape(self, h):
        return h.shape

    def dtype(self, h):
        return h.dtype

    def to_list(self, h):
        return h.values


def decoder_sig(layers: tuple[int, ...] = (0, 1)) -> Signature:
    ins = [TensorInfo("input_ids", "int64", ("b", "s")), TensorInfo("attention_mask", "int64", ("b", "t")),
           TensorInfo("position_ids", "int64", ("b", "s"))]
    outs = [TensorInfo("logits", "float32", ("b", "s", 10))]
    for i in layers:
        for kind in ("key", "value"):
            ins.append(TensorInfo(f"past_key_values.{i}.{kind}", "float32", ("b", 2, "p", 4)))
            outs.append(TensorInfo(f"present.{i}.{kind}", "float32", ("b", 2, "t", 4)))
    return Signature(tuple(ins), tuple(outs))


def make_generator(tmp_path: Path, kv: dict, max_length: int = 8, eos: tuple = (9,),
                   sig: Signature | None = None, backend: FakeBackend | None = None) -> TokenGenerator:
    (tmp_path / "model.onnx").write_bytes(b"")
    (tmp_path / "genai_config.json").write_text(json.dumps(
        {"version": 2, "pipeline": {"extends": "autoregressive-decoder", "state": {"kv_cache": kv}}}))
    plan = make_plan(load_config(LocalFolder(tmp_path)), {"decoder": sig or decoder_sig()})
    return TokenGenerator(plan, backend or FakeBackend(), Limits(max_length, frozenset(eos)))


def scripted(gen: TokenGenerator, picks: list[int], present_len=None) -> list[Run]:
    """Drive next_token() for each pick; the fake decoder returns presents of the right length."""
    runs = []
    for pick in picks:
        work = gen.next_token()
        request = next(work)
        try:
            while True:
                runs.append(request)
                if request.session.startswith("kernel:argmax_last"):
                    reply = {"token": FakeTensor([pick], (1,), "int64")}
                elif request.session.startswith("kernel:narrow"):
                    x, start = request.feeds["x"], request.feeds["start"].values[0]
                    shape = list(x.shape)
                    shape[2] = -start
                    reply = {"y": FakeTensor([], tuple(shape), x.dtype)}
                else:
                    total = request.feeds["attention_mask"].shape[1]
                    reply = {"logits": FakeTensor([], (1, 1, 10), "float32")}
                    for name in request.outputs:  # a target writes shared-buffer presents in place
                        if name.startswith("present") and name not in (request.inplace or {}):
                            length = present_len(name, total) if present_len else total
                            reply[name] = FakeTensor([], (1, 2, length, 4), "float32")
                request = work.send(reply)
        except StopIteration as stop:
            assert stop.value == pick
    return runs


def test_prefill_then_one_decode_run_per_token(tmp_path: Path) -> None:
    gen = make_generator(tmp_path, {"format": "auto"})
    gen.append_tokens([5, 6, 7])
    runs = scripted(gen, [1, 2, 3])
    decoder = [r for r in runs if r.session == "decoder"]
    assert len(decoder) == 3  # prefill + 2 decodes for 3 tokens
    assert decoder[0].feeds["input_ids"].values == [5, 6, 7]
    assert decoder[0].feeds["position_ids"].values == [0, 1, 2]
    assert decoder[0].feeds["past_key_values.0.key"].shape == (1, 2, 0, 4)
    assert decoder[1].feeds["input_ids"].values == [1]
    assert decoder[1].feeds["position_ids"].values == [3]
    assert decoder[1].feeds["attention_mask"].shape == (1, 4)
    assert decoder[2].feeds["past_key_values.1.value"].shape == (1, 2, 4, 4)
    assert decoder[0].inplace is None
    assert gen.tokens == [5, 6, 7, 1, 2, 3]


def test_shared_buffer_is_sized_from_max_length_and_bound_in_place(tmp_path: Path) -> None:
    gen = make_generator(tmp_path, {"share_buffer": True}, max_length=7)
    gen.append_tokens([5, 6, 7])
    runs = [r for r in scripted(gen, [1, 2], present_len=lambda name, total: 7) if r.session == "decoder"]
    buffer = runs[0].feeds["past_key_values.0.key"]
    assert buffer.shape == (1, 2, 7, 4)
    assert runs[1].feeds["past_key_values.0.key"] is buffer  # the same buffer every step
    assert runs[0].inplace == {
        "present.0.key": "past_key_values.0.key",
        "present.0.value": "past_key_values.0.value",
        "present.1.key": "past_key_values.1.key",
        "present.1.value": "past_key_values.1.value",
    }
    assert runs[1].feeds["attention_mask"].shape == (1, 4)


def test_sliding_window_layers_are_trimmed_by_the_kernel(tmp_path: Path) -> None:
    gen = make_generator(tmp_path, {"sliding_window": {"window_size": 3, "layers": [1]}}, max_length=10)
    gen.append_tokens([5, 6, 7, 8])
    runs = scripted(gen, [1, 2])
    trims = [r for r in runs if r.session.startswith("kernel:narrow")]
    assert {r.feeds["x"].shape for r in trims} == {(1, 2, 4, 4), (1, 2, 5, 4)}
    decode = [r for r in runs if r.session == "decoder"][1]
    assert decode.feeds["past_key_values.1.key"].shape == (1, 2, 3, 4)  # windowed layer
    assert decode.feeds["past_key_values.0.key"].shape == (1, 2, 4, 4)  # full layer


def test_sparse_layers_come_from_the_signature(tmp_path: Path) -> None:
    gen = make_generator(tmp_path, {"format": "separate"}, sig=decoder_sig((0, 2, 5)))
    assert gen.plan.step_phase[0].kv.layers == [0, 2, 5]


def test_stops_at_eos_and_max_length(tmp_path: Path) -> None:
    gen = make_generator(tmp_path, {}, max_length=8, eos=(9,))
    gen.append_tokens([5, 6])
    scripted(gen, [1, 9])
    assert gen.done
    with pytest.raises(GenerationError, match="generation is done"):
        next(gen.next_token())
    gen = make_generator(tmp_path, {}, max_length=4, eos=(9,))
    gen.append_tokens([5, 6])
    scripted(gen, [1, 2])
    assert gen.done and len(gen.tokens) == 4


def test_continuous_decoding_appends_without_re_running_history(tmp_path: Path) -> None:
    gen = make_generator(tmp_path, {}, max_length=20)
    gen.append_tokens([5, 6])
    scripted(gen, [1, 2])
    gen.append_tokens([7, 8])
    runs = [r for r in scripted(gen, [3]) if r.session == "decoder"]
    assert runs[0].feeds["input_ids"].values == [2, 7, 8]  # last generated token + the new turn
    assert runs[0].feeds["position_ids"].values == [3, 4, 5]


def test_bad_prompts_are_refused_before_running(tmp_path: Path) -> None:
    gen = make_generator(tmp_path, {}, max_length=4)
    with pytest.raises(GenerationError, match="non-empty list of integers from 0"):
        gen.append_tokens([1, -2])
    with pytest.raises(GenerationError, match="do not fit in max_length 4"):
        gen.append_tokens([1, 2, 3, 4, 5])


class FusingBackend(FakeBackend):
    fused_layouts = frozenset({"concat"})  # what the browser driver fuses, less the shared buffer


@pytest.mark.parametrize(
    "kv, fused",
    [
        ({"format": "auto"}, True),
        ({"share_buffer": True}, False),
        ({"sliding_window": {"window_size": 3, "layers": [1]}}, False),
    ],
)
def test_decode_steps_are_fused_only_for_layouts_the_backend_names(
    tmp_path: Path, kv: dict, fused: bool
) -> None:
    gen = make_generator(tmp_path, kv, max_length=10, backend=FusingBackend())
    gen.append_tokens([5, 6, 7])
    scripted(gen, [1], present_len=(lambda name, total: 10) if kv.get("share_buffer") else None)
    work = gen.next_token()
    request = next(work)
    assert isinstance(request, Decode) is fused
    if not fused:
        assert request.session == "decoder"  # the generic step
        return
    cache = gen.flow.caches["decoder"]
    assert request.cache is cache.feeds  # the cache as the core holds it, to read
    step = request.step
    assert (request.token, request.position, step.layout) == (1, 3, "concat")
    assert step.presents["present.1.value"] == "past_key_values.1.value"
    assert (step.ids, step.mask, step.positions) == (
        ("input_ids", "int64"),
        ("attention_mask", "int64"),
        ("position_ids", "int64"),
    )
    assert (step.logits, step.logits_shape, request.capacity) == ("logits", (1, 1, 10), 10)
    assert request.limit == 1 and request.eos == frozenset({9})  # one step, unless the backend bursts
    after = {name: FakeTensor([], (1, 2, 4, 4), "float32") for name in request.cache}
    with pytest.raises(StopIteration) as stop:
        work.send(Decoded([4], after))
    assert stop.value.value == 4
    assert cache.feeds == after  # the cache the target answered is the core's from now on
    # the graph has seen the prompt and token 1; token 4 waits for the next step
    assert (gen.tokens, gen.fused_steps, cache.length, gen.flow.position) == ([5, 6, 7, 1, 4], 1, 4, 4)


class BurstingBackend(FusingBackend):
    decode_burst = 4  # a target that answers a Decode with up to 4 tokens (the browser's JS Decoder)


def test_a_burst_of_decode_steps_gives_several_tokens(tmp_path: Path) -> None:
    gen = make_generator(tmp_path, {"format": "auto"}, max_length=12, backend=BurstingBackend())
    gen.append_tokens([5, 6, 7])
    scripted(gen, [1])
    work = gen.next_tokens()
    request = next(work)
    assert (request.token, request.position, request.limit) == (1, 3, 4)
    with pytest.raises(StopIteration) as stop:
        work.send(
            Decoded([4, 3, 2], request.cache)
        )  # three steps: fed 1, 4 and 3; token 2 waits for the next one
    assert stop.value.value == [4, 3, 2]
    cache = gen.flow.caches["decoder"]
    assert (cache.length, gen.flow.position, gen.fused_steps) == (6, 6, 3)
    assert gen.tokens == [5, 6, 7, 1, 4, 3, 2]
    work = gen.next_tokens(budget=2)  # the caller takes two more tokens at most
    request = next(work)
    assert (request.token, request.position, request.limit) == (2, 6, 2)
    with pytest.raises(StopIteration):
        work.send(Decoded([8, 9], request.cache))  # 9: eos
    assert gen.done and gen.tokens == [5, 6, 7, 1, 4, 3, 2, 8, 9] and gen.flow.position == 8


def test_a_burst_stops_at_the_length_limit_and_next_token_asks_for_one(tmp_path: Path) -> None:
    gen = make_generator(tmp_path, {"format": "auto"}, max_length=7, backend=BurstingBackend())
    gen.append_tokens([5, 6, 7])
    scripted(gen, [1])
    work = gen.next_tokens()
    decode = next(work)
    assert decode.limit == 3  # 7 - 4 ids so far
    with pytest.raises(StopIteration):
        work.send(Decoded([4], decode.cache))
    assert next(gen.next_token()).limit == 1  # the step-wise API: one token a call (room for 2)


@pytest.mark.parametrize("tokens", [[], [4, 3, 2, 1, 0], [9, 4], "an int", "a bare list"])
def test_a_wrong_answer_to_a_burst_is_refused(tmp_path: Path, tokens: object) -> None:
    gen = make_generator(tmp_path, {"format": "auto"}, max_length=12, backend=BurstingBackend())
    gen.append_tokens([5, 6, 7])
    scripted(gen, [1])
    work = gen.next_tokens()
    request = next(work)
    answer = (
        {"an int": 4, "a bare list": [4]}[tokens]
        if isinstance(tokens, str)
        else Decoded(tokens, request.cache)
    )
    with pytest.raises(GenerationError, match="must answer 1 to that many token ids, stopping after an eos"):
        work.send(answer)
