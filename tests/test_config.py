"""Config loading and load-time validation: each error names the problem and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ortpipe.config import load_config
from ortpipe.config.expand import as_v2
from ortpipe.errors import ConfigError
from ortpipe.folder import LocalFolder
from ortpipe.plan import make_plan
from ortpipe.signature import Signature, TensorInfo


def folder_with(tmp_path: Path, config: dict | str, files: tuple[str, ...] = ("model.onnx",)) -> LocalFolder:
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    text = config if isinstance(config, str) else json.dumps(config, indent=2)
    (tmp_path / "genai_config.json").write_text(text)
    return LocalFolder(tmp_path)


def v2(pipeline: dict, **rest) -> dict:
    return {"version": 2, "pipeline": pipeline, **rest}


def errors_of(tmp_path: Path, config: dict | str, files: tuple[str, ...] = ("model.onnx",)) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(folder_with(tmp_path, config, files))
    return str(info.value)


VLM_FILES = ("vision.onnx", "embedding.onnx", "decoder.onnx")
VLM_SESSIONS = {"vision": {"file": "vision.onnx"}, "embedding": {"file": "embedding.onnx"},
                "decoder": {"file": "decoder.onnx"}}


def test_minimal_v2_expands_the_preset(tmp_path: Path) -> None:
    config = load_config(folder_with(tmp_path, v2({"extends": "autoregressive-decoder"}, tokens={"eos": 7})))
    assert config.source == "v2"
    assert [(s.run, s.when) for s in config.pipeline.flow] == [("decoder", "step")]
    assert config.pipeline.sessions["decoder"].file == "model.onnx"
    assert config.tokens.eos == (7,)


def test_overrides_replace_preset_values_and_when_aliases_resolve(tmp_path: Path) -> None:
    config = load_config(folder_with(tmp_path, v2({
        "extends": "vision-language", "sessions": VLM_SESSIONS,
        "flow": [{"run": "vision", "when": "prompt", "loop": "per_image", "loop_over": "pixel_values"},
                 {"run": "embedding", "when": "once"}, {"run": "decoder", "when": "always"}],
        "state": {"position_ids": {"strategy": "mrope_3d", "grid_source": "vision.image_grid_thw"}},
    }), VLM_FILES))
    assert [s.when for s in config.pipeline.flow] == ["init", "init", "step"]
    assert config.pipeline.flow[0].loop == "per_image"
    assert config.pipeline.state.position_ids.strategy == "mrope_3d"
    assert config.pipeline.state.kv_cache.format == "auto"  # kept from the preset
    assert set(config.pipeline.sessions) == {"vision", "embedding", "decoder"}


def test_flow_step_naming_an_undeclared_session(tmp_path: Path) -> None:
    msg = errors_of(tmp_path, v2({"sessions": VLM_SESSIONS, "flow": [
        {"run": "visoin", "when": "init"}, {"run": "decoder", "when": "step"}]}), VLM_FILES)
    assert 'references session "visoin" but no such session is declared in pipeline.sessions' in msg
    assert 'Did you mean "vision"?' in msg


@pytest.mark.parametrize("field,value,valid", [
    ("when", "sometimes", "init, step, final"),
    ("loop", "per_frame", "batched, per_image"),
])
def test_unknown_flow_vocabulary_lists_valid_values(
    tmp_path: Path, field: str, value: str, valid: str
) -> None:
    step = {"run": "decoder", "when": "step", field: value}
    msg = errors_of(tmp_path, v2({"sessions": {"decoder": {"file": "model.onnx"}}, "flow": [step]}))
    assert f'"{value}"' in msg and f"Valid options: {valid}" in msg


def test_unknown_position_strategy(tmp_path: Path) -> None:
    msg = errors_of(
        tmp_path,
        v2({"extends": "autoregressive-decoder", "state": {"position_ids": {"strategy": "my_custom"}}}),
    )
    assert 'Unknown position_ids strategy "my_custom"' in msg
    assert "Valid options: auto, default, mrope_3d, windowed" in msg


def test_unknown_preset_lists_presets_and_suggests(tmp_path: Path) -> None:
    msg = errors_of(tmp_path, v2({"extends": "vision-languag"}))
    assert 'Unknown pipeline preset "vision-languag"' in msg
    assert (
        "Built-in presets: autoregressive-decoder, vision-language, encoder-decoder, speech-language" in msg
    )
    assert 'Did you mean "vision-language"?' in msg


def test_no_sessions(tmp_path: Path) -> None:
    msg = errors_of(tmp_path, v2({"sessions": {}, "flow": []}))
    assert "requires at least one session" in msg and '"sessions": {"decoder": {"file": "model.onnx"}}' in msg


def test_session_file_missing(tmp_path: Path) -> None:
    msg = errors_of(
        tmp_path,
        v2({"sessions": {"decoder": {"file": "decoder.onnx"}}, "flow": [{"run": "decoder", "when": "step"}]}),
    )
    assert '"decoder.onnx" does not exist' in msg and str(tmp_path) in msg


def test_session_file_outside_the_folder(tmp_path: Path) -> None:
    msg = errors_of(
        tmp_path,
        v2({"sessions": {"decoder": {"file": "../x.onnx"}}, "flow": [{"run": "decoder", "when": "step"}]}),
    )
    assert '"../x.onnx" points outside the model folder' in msg


def test_more_than_ten_flow_steps(tmp_path: Path) -> None:
    flow = [{"run": "decoder", "when": "step"}] * 11
    msg = errors_of(tmp_path, v2({"sessions": {"decoder": {"file": "model.onnx"}}, "flow": flow}))
    assert "pipeline.flow has 11 steps; at most 10 are allowed" in msg


def test_malformed_json_names_line_and_column(tmp_path: Path) -> None:
    msg = errors_of(tmp_path, '{\n  "version": 2,\n  "pipeline": {"extends": "autoregressive-decoder",}\n}')
    assert "is not valid JSON" in msg and "line 3, column" in msg


def test_cycle_in_dataflow_shows_the_cycle(tmp_path: Path) -> None:
    msg = errors_of(
        tmp_path,
        v2(
            {
                "sessions": VLM_SESSIONS,
                "flow": [
                    {"run": "vision", "when": "init"},
                    {"run": "embedding", "when": "init"},
                    {"run": "decoder", "when": "step"},
                ],
                "dataflow": [
                    {"from": "vision.image_features", "to": "embedding.image_features"},
                    {"from": "embedding.inputs_embeds", "to": "decoder.inputs_embeds"},
                    {"from": "decoder.hidden", "to": "vision.hint"},
                ],
            }
        ),
        VLM_FILES,
    )
    assert "Circular dependency detected" in msg
    assert "decoder → vision → embedding → decoder" in msg


def test_cycle_through_after(tmp_path: Path) -> None:
    msg = errors_of(
        tmp_path,
        v2(
            {
                "sessions": VLM_SESSIONS,
                "flow": [
                    {"run": "vision", "when": "init", "after": ["embedding"]},
                    {"run": "embedding", "when": "init", "after": ["vision"]},
                    {"run": "decoder", "when": "step"},
                ],
            }
        ),
        VLM_FILES,
    )
    assert "embedding → vision → embedding" in msg


def test_unknown_key_is_named_with_a_suggestion(tmp_path: Path) -> None:
    msg = errors_of(tmp_path, v2({"extends": "autoregressive-decoder", "sesions": {}}))
    assert 'Unknown key "sesions" in pipeline. Did you mean "sessions"?' in msg


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            folder_with(
                tmp_path,
                v2(
                    {
                        "sessions": {"decoder": {"file": "../x.onnx"}},
                        "flow": [{"run": "decoder", "when": "never", "loop": "twice"}],
                    }
                ),
            )
        )
    assert len(info.value.problems) == 3


# Checks that need the graphs' signatures (plan time).


def sig(inputs: list[tuple[str, str, tuple]], outputs: list[tuple[str, str, tuple]]) -> Signature:
    return Signature(tuple(TensorInfo(*t) for t in inputs), tuple(TensorInfo(*t) for t in outputs))


DECODER = sig(
    [
        ("input_ids", "int64", ("b", "s")),
        ("attention_mask", "int64", ("b", "t")),
        ("past_key_values.0.key", "float32", ("b", 2, "p", 8)),
        ("past_key_values.0.value", "float32", ("b", 2, "p", 8)),
    ],
    [
        ("logits", "float32", ("b", "s", 50)),
        ("present.0.key", "float32", ("b", 2, "t", 8)),
        ("present.0.value", "float32", ("b", 2, "t", 8)),
    ],
)


def test_dataflow_wire_to_a_missing_output_lists_the_outputs(tmp_path: Path) -> None:
    config = load_config(
        folder_with(
            tmp_path,
            v2(
                {
                    "sessions": {"vision": {"file": "vision.onnx"}, "decoder": {"file": "decoder.onnx"}},
                    "flow": [{"run": "vision", "when": "init"}, {"run": "decoder", "when": "step"}],
                    "dataflow": [{"from": "vision.image_features", "to": "decoder.inputs_embeds"}],
                }
            ),
            ("vision.onnx", "decoder.onnx"),
        )
    )
    vision = sig(
        [("pixel_values", "float32", ("b", 3, 8, 8))],
        [("hidden_states", "float32", ("b", 4, 16)), ("pooler_output", "float32", ("b", 16))],
    )
    with pytest.raises(ConfigError) as info:
        make_plan(config, {"vision": vision, "decoder": DECODER})
    msg = str(info.value)
    assert 'references output "image_features" but session "vision" has no such output' in msg
    assert "(available outputs: hidden_states, pooler_output)" in msg


def test_an_input_the_plan_cannot_feed_is_named(tmp_path: Path) -> None:
    config = load_config(folder_with(tmp_path, v2({"extends": "autoregressive-decoder"})))
    odd = sig(
        [*((t.name, t.dtype, t.shape) for t in DECODER.inputs), ("speaker_embedding", "float32", ("b", 16))],
        [(t.name, t.dtype, t.shape) for t in DECODER.outputs],
    )
    with pytest.raises(ConfigError) as info:
        make_plan(config, {"decoder": odd})
    assert 'Session "decoder" input "speaker_embedding" (float32 [\'b\', 16]) cannot be fed' in str(
        info.value
    )


def test_plan_detects_separate_cache_and_feeds(tmp_path: Path) -> None:
    config = load_config(folder_with(tmp_path, v2({"extends": "autoregressive-decoder"})))
    plan = make_plan(config, {"decoder": DECODER})
    step = plan.step_phase[0]
    assert [(f.input, f.kind) for f in step.feeds] == [
        ("input_ids", "input_ids"),
        ("attention_mask", "attention_mask"),
        ("past_key_values.0.key", "kv_past"),
        ("past_key_values.0.value", "kv_past"),
    ]
    assert step.kv.format == "separate" and step.kv.layers == [0]
    assert step.kv.entries[0].shape == (None, 2, None, 8)
    assert plan.generator is step


def test_expanded_config_round_trips(tmp_path: Path) -> None:
    config = load_config(
        folder_with(tmp_path, v2({"extends": "autoregressive-decoder"}, tokens={"eos": [2, 3]}))
    )
    again = load_config(folder_with(tmp_path / "again", as_v2(config)))
    assert again.pipeline == config.pipeline and again.tokens == config.tokens


def test_v1_unknown_model_type_is_metadata_only(tmp_path: Path) -> None:
    v1 = {
        "model": {
            "type": "my_finetune",
            "eos_token_id": [2, 32000],
            "bos_token_id": 1,
            "pad_token_id": 0,
            "context_length": 4096,
            "decoder": {
                "filename": "model.onnx",
                "head_size": 8,
                "num_key_value_heads": 2,
                "session_options": {"log_id": "x", "intra_op_num_threads": 1, "provider_options": []},
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {"max_length": 256, "past_present_share_buffer": True, "do_sample": False, "top_k": 1},
    }
    config = load_config(folder_with(tmp_path, v1))
    assert config.source == "v1" and config.metadata["model_type"] == "my_finetune"
    assert config.tokens.eos == (2, 32000) and config.tokens.bos == 1
    kv = config.pipeline.state.kv_cache
    assert kv.share_buffer and kv.past_key_pattern == "past_key_values.{layer}.key"
    assert config.generation.max_length == 256
    assert config.pipeline.sessions["decoder"].session_options == {"intra_op_num_threads": 1}
    plan = make_plan(config, {"decoder": DECODER})
    assert plan.step_phase[0].kv.share_buffer


def test_detected_config_takes_tokens_from_generation_config(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "eos_token_id": 2, "max_position_embeddings": 512})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5], "bos_token_id": 1}))
    config = load_config(LocalFolder(tmp_path))
    assert config.source == "detected"
    assert config.tokens.eos == (2, 5) and config.tokens.bos == 1
    assert config.generation.max_length == 512


def test_detected_config_samples_as_transformers_reads_generation_config(tmp_path: Path) -> None:
    """do_sample true brings temperature, top_k, top_p and min_p, transformers' GenerationConfig defaults for
    those left out (top_k 50); a repetition_penalty holds in greedy search too; a value ortpipe refuses
    names the file's key."""
    (tmp_path / "model.onnx").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    from transformers import GenerationConfig

    cases = [({"do_sample": True, "temperature": 0.7, "top_p": 0.8}, True),
             ({"do_sample": True}, True),
             ({"do_sample": False, "top_k": 5, "repetition_penalty": 1.3}, False),
             ({"temperature": 0.6}, False)]
    for given, samples in cases:
        (tmp_path / "generation_config.json").write_text(json.dumps(given))
        settings = load_config(LocalFolder(tmp_path)).generation.settings
        reference = GenerationConfig(**given)  # what transformers' generate takes, with its defaults
        defaults = reference._get_default_generation_params()
        expected = {k: getattr(reference, k) if getattr(reference, k) is not None else defaults.get(k)
                    for k in ("temperature", "top_k", "top_p", "repetition_penalty")}
        assert settings.do_sample is samples
        assert settings.repetition_penalty == expected["repetition_penalty"]
        if samples:
            assert (settings.temperature, settings.top_k, settings.top_p) == (
                expected["temperature"], expected["top_k"], expected["top_p"]), given
        else:  # transformers does not apply them without do_sample: neither is anything set here
            assert (settings.temperature, settings.top_k, settings.top_p) == (1.0, 0, 1.0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 2}))
    with pytest.raises(ConfigError, match=r"generation_config.json: top_p .*fix it there, or give the"):
        load_config(LocalFolder(tmp_path))


def test_v1_vision_embedding_decoder_translate_to_init_steps(tmp_path: Path) -> None:
    v1 = {
        "model": {
            "type": "phi3v",
            "eos_token_id": 2,
            "image_token_id": 9,
            "vision": {
                "filename": "vision.onnx",
                "inputs": {"pixel_values": "pixel_values", "image_sizes": "image_sizes"},
                "outputs": {"image_features": "image_features"},
            },
            "embedding": {
                "filename": "embedding.onnx",
                "inputs": {"input_ids": "input_ids", "image_features": "image_features"},
                "outputs": {"inputs_embeds": "inputs_embeds"},
            },
            "decoder": {"filename": "decoder.onnx", "inputs": {"inputs_embeds": "inputs_embeds"}},
        },
        "search": {"max_length": 64},
    }
    config = load_config(folder_with(tmp_path, v1, VLM_FILES))
    assert [(s.run, s.when, s.optional) for s in config.pipeline.flow] == [
        ("vision", "init", True),
        ("embedding", "init", False),
        ("decoder", "step", False),
    ]
    assert config.tokens.image_token == 9 and config.pipeline.dataflow == ()


def test_v1_encoder_decoder_translates_the_cross_cache_and_renamed_outputs(tmp_path: Path) -> None:
    v1 = {
        "model": {
            "type": "whisper",
            "eos_token_id": 3,
            "decoder_start_token_id": 1,
            "encoder": {
                "filename": "encoder.onnx",
                "inputs": {"audio_features": "audio_features"},
                "outputs": {
                    "encoder_hidden_states": "hidden_states",
                    "cross_present_key_names": "present_key_cross_%d",
                },
            },
            "decoder": {
                "filename": "decoder.onnx",
                "inputs": {
                    "input_ids": "input_ids",
                    "encoder_hidden_states": "enc",
                    "past_key_names": "past_key_self_%d",
                    "cross_past_key_names": "past_key_cross_%d",
                },
                "outputs": {"logits": "logits", "present_key_names": "present_key_self_%d"},
            },
        }
    }
    config = load_config(folder_with(tmp_path, v1, ("encoder.onnx", "decoder.onnx")))
    assert [(s.run, s.when) for s in config.pipeline.flow] == [("encoder", "init"), ("decoder", "step")]
    assert config.pipeline.state.cross_cache.source == "encoder"
    assert [str(w) for w in config.pipeline.dataflow] == ["encoder.hidden_states -> decoder.enc"]
    assert config.pipeline.state.kv_cache.past_key_pattern == "past_key_self_{layer}"
    assert config.tokens.decoder_start == 1


def test_v1_split_decoder_pipeline_is_refused_clearly(tmp_path: Path) -> None:
    v1 = {
        "model": {
            "type": "qnn",
            "eos_token_id": 2,
            "decoder": {
                "pipeline": [
                    {"context": {"filename": "ctx.onnx", "run_on_prompt": True, "run_on_token_gen": False}}
                ]
            },
        }
    }
    msg = errors_of(tmp_path, v1, ("ctx.onnx",))
    assert "stage 'context' runs only on the prompt" in msg


def test_per_image_errors_fire_for_multi_session_configs(tmp_path: Path) -> None:
    sessions = {"vision": {"file": "vision.onnx"}, "decoder": {"file": "decoder.onnx"}}
    config = load_config(
        folder_with(
            tmp_path,
            v2(
                {
                    "sessions": sessions,
                    "flow": [
                        {
                            "run": "vision",
                            "when": "init",
                            "loop": "per_image",
                            "loop_over": "pixel_value",
                            "dynamic_shape": {"source": "image_sizes", "apply_to_dims": [2, 3]},
                        },
                        {"run": "decoder", "when": "step"},
                    ],
                }
            ),
            ("vision.onnx", "decoder.onnx"),
        )
    )
    vision = sig(
        [("pixel_values", "float32", ("n", 3, "h", "w"))], [("image_features", "float32", ("t", 16))]
    )
    with pytest.raises(ConfigError) as info:
        make_plan(config, {"vision": vision, "decoder": DECODER})
    assert 'loops over "pixel_value", but session "vision" has no such input' in str(info.value)
    assert 'Did you mean "pixel_values"?' in str(info.value)
    msg = errors_of(
        tmp_path / "nosource",
        v2(
            {
                "sessions": sessions,
                "flow": [
                    {
                        "run": "vision",
                        "when": "init",
                        "loop": "per_image",
                        "loop_over": "pixel_values",
                        "dynamic_shape": {"apply_to_dims": [2, 3]},
                    },
                    {"run": "decoder", "when": "step"},
                ],
            }
        ),
        ("vision.onnx", "decoder.onnx"),
    )
    assert 'dynamic_shape needs "source"' in msg
    msg = errors_of(
        tmp_path / "noloop",
        v2(
            {
                "sessions": sessions,
                "flow": [
                    {"run": "vision", "when": "init", "loop": "per_image"},
                    {"run": "decoder", "when": "step"},
                ],
            }
        ),
        ("vision.onnx", "decoder.onnx"),
    )
    assert 'loop "per_image" but no "loop_over"' in msg


# --- execution providers and session options (config/ep.py is the one table) -------------------


def test_providers_and_their_options_are_normalised(tmp_path: Path) -> None:
    session = {
        "file": "model.onnx",
        "execution_provider": ["OpenVINOExecutionProvider", "CPU"],
        "provider_options": {"OpenVINO": {"device_type": "NPU", "num_streams": 2}},
        "session_options": {
            "graph_optimization_level": "all",
            "execution_mode": "ORT_PARALLEL",
            "openvino": {"intra_op_num_threads": 1},
        },
    }
    config = load_config(
        folder_with(tmp_path, v2({"extends": "autoregressive-decoder", "sessions": {"decoder": session}}))
    )
    decoder = config.pipeline.sessions["decoder"]
    assert decoder.providers == ("openvino", "cpu")
    assert decoder.provider_options == {"openvino": {"device_type": "NPU", "num_streams": "2"}}
    assert decoder.session_options == {
        "graph_optimization_level": "ORT_ENABLE_ALL",
        "execution_mode": "ORT_PARALLEL",
        "openvino": {"intra_op_num_threads": 1},
    }
    again = load_config(folder_with(tmp_path / "again", as_v2(config)))
    assert again.pipeline.sessions["decoder"] == decoder


def test_bad_providers_and_session_options_are_each_named(tmp_path: Path) -> None:
    session = {
        "file": "model.onnx",
        "execution_provider": ["openvno", "cpu"],
        "provider_options": {"qnn": {"backend_type": "hpt"}},
        "session_options": {
            "intra_op_threads": 2,
            "inter_op_num_threads": 5000,
            "graph_optimization_level": "most",
            "config_entries": {"a": 1},
        },
    }
    msg = errors_of(tmp_path, v2({"extends": "autoregressive-decoder", "sessions": {"decoder": session}}))
    assert "6 problems" in msg
    assert 'Unknown execution provider "openvno" in pipeline.sessions.decoder.execution_provider' in msg
    assert 'Did you mean "openvino"?' in msg
    assert 'backend_type "hpt" is not a QNN backend' in msg and 'Did you mean "htp"?' in msg
    assert (
        'Unknown key "intra_op_threads" in pipeline.sessions.decoder.session_options. Did you mean '
        '"intra_op_num_threads"?' in msg
    )
    assert "inter_op_num_threads must be from 0 (onnxruntime decides) to 1024, found 5000" in msg
    assert 'graph_optimization_level "most" is not one of ORT_DISABLE_ALL' in msg
    assert "config_entries maps onnxruntime session config keys to string values" in msg


def test_v1_session_options_and_builder_providers_carry_over(tmp_path: Path) -> None:
    """The model builder's names (ORT_ENABLE_ALL, webgpu) load; onnxruntime-genai appends the CPU."""
    v1 = {
        "model": {
            "type": "phi3",
            "context_length": 64,
            "eos_token_id": 2,
            "decoder": {
                "filename": "model.onnx",
                "head_size": 8,
                "num_key_value_heads": 2,
                "session_options": {
                    "graph_optimization_level": "ORT_ENABLE_EXTENDED",
                    "enable_cpu_mem_arena": False,
                    "provider_options": [{"webgpu": {"enableGraphCapture": "1"}}],
                },
                "inputs": {"input_ids": "input_ids"},
                "outputs": {"logits": "logits"},
            },
        }
    }
    decoder = load_config(folder_with(tmp_path, v1)).pipeline.sessions["decoder"]
    assert decoder.session_options == {
        "graph_optimization_level": "ORT_ENABLE_EXTENDED",
        "enable_cpu_mem_arena": False,
    }
    assert decoder.providers == ("webgpu", "cpu")
    assert decoder.provider_options == {"webgpu": {"enableGraphCapture": "1"}}


def test_a_profile_is_layered_before_the_config_is_checked(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, v2({"extends": "vision-language", "sessions": VLM_SESSIONS}), VLM_FILES)
    sessions = load_config(folder, profile="snapdragon-npu").pipeline.sessions
    assert sessions["vision"].providers == ("qnn", "cpu") and sessions["decoder"].providers == ("cpu",)
    assert sessions["vision"].provider_options["qnn"]["backend_type"] == "htp"
    assert load_config(folder).pipeline.sessions["vision"].providers == ("cpu",)
    with pytest.raises(ConfigError, match='Unknown profile "raspberry". .* Did you mean "raspberry-pi"?'):
        load_config(folder, profile="raspberry")


def test_decoder_start_is_an_id_or_the_decoders_first_ids(tmp_path: Path) -> None:
    pipeline = {"extends": "autoregressive-decoder"}
    one = load_config(folder_with(tmp_path / "one", v2(pipeline, tokens={"decoder_start": 7})))
    assert (one.tokens.decoder_start, one.tokens.decoder_prompt) == (7, (7,))
    listed = v2(pipeline, tokens={"decoder_start": [7, 9, 4]})
    several = load_config(folder_with(tmp_path / "several", listed))
    assert (several.tokens.decoder_start, several.tokens.decoder_prompt) == (7, (7, 9, 4))
    none = load_config(folder_with(tmp_path / "none", v2(pipeline)))
    assert (none.tokens.decoder_start, none.tokens.decoder_prompt) == (None, ())
    for i, bad in enumerate(([], [7, "x"], [7, -1], [True])):
        message = errors_of(tmp_path / f"bad{i}", v2(pipeline, tokens={"decoder_start": bad}))
        assert "tokens.decoder_start must be a token id or a non-empty list of token ids" in message
    assert "tokens.decoder_start must be at least 0" in errors_of(
        tmp_path / "negative", v2(pipeline, tokens={"decoder_start": -2}))
