"""The synthesis parameter table: every bound, both sides, through the Python API and the HTTP field check."""

from __future__ import annotations

import argparse
import math

import pytest

from higgs_rt.params import (BY_API_NAME, BY_NAME, MAX_FRAMES, PARAMS, RAS_WINDOW, ParamError, SamplingParams,
                             SynthesisParams, add_cli_options, api_name, check_api_field)

# name -> (values accepted at the bounds, values refused just past them and of the wrong kind)
CASES = {
    "seed": ([0, 2**63 - 1], [-1, 2**63, 2**64, 1.5, True, "1", float("nan")]),
    "temperature": ([0, 0.0, 1, 100.0], [-1e-9, 100.5, float("inf"), float("-inf"), float("nan"), 1e308 * 10, 2**60,
                                         True, "1.0", None]),
    "top_p": ([1e-9, 0.5, 1, 1.0], [0, 0.0, -0.1, 1.0000001, float("nan"), False]),
    "top_k": ([0, 1, 2**31 - 1], [-1, 2**31, 2**63, 2**64, 10**4301, 3.5, True]),
    "ras_window": ([0, RAS_WINDOW], [1, RAS_WINDOW + 1, -1, 2.5]),
    "ras_max_repeat": ([1, RAS_WINDOW], [0, RAS_WINDOW + 1, True]),
    "max_frames": ([9, MAX_FRAMES, 65536], [8, 0, -5, 65537, 10**100, 9.5, False]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bounds_through_the_api(name):
    good, bad = CASES[name]
    for value in good:
        p = SynthesisParams.create(**{name: value})
        assert getattr(p, name) == value and type(getattr(p, name)) is BY_NAME[name].kind
    for value in bad:
        with pytest.raises(ValueError, match=rf"^{name} must "):
            SynthesisParams.create(**{name: value})


@pytest.mark.parametrize("param", [p for p in PARAMS if p.api_name], ids=lambda p: p.api_name)
def test_http_field_checks_name_the_api_field(param):
    good, bad = CASES[param.name]
    for value in good:
        assert check_api_field(param.api_name, value) == value
    for value in bad:
        with pytest.raises(ValueError, match=rf"^{param.api_name} must "):
            check_api_field(param.api_name, value)


def test_numpy_scalars_are_taken_as_python_numbers():
    import numpy as np

    p = SynthesisParams.create(seed=np.int64(7), temperature=np.float32(0.5), top_k=np.uint16(20),
                               max_frames=np.float64(30.0))
    assert (p.seed, p.temperature, p.top_k, p.max_frames) == (7, 0.5, 20, 30)
    assert [type(v) for v in (p.seed, p.temperature, p.top_k, p.max_frames)] == [int, float, int, int]
    for name, value in [("seed", np.int64(-1)), ("temperature", np.float32("nan")), ("top_k", np.float64(2.5)),
                        ("seed", np.bool_(True)), ("top_p", np.array([0.5]))]:
        with pytest.raises(ValueError, match=rf"^{name} must "):
            SynthesisParams.create(**{name: value})


def test_api_names():
    assert set(BY_API_NAME) == {"seed", "temperature", "top_p", "top_k", "max_new_tokens"}
    assert BY_API_NAME["max_new_tokens"].name == "max_frames"


def test_a_refused_value_carries_its_parameter():
    """A refusal is a ParamError carrying the table's name, whatever name its message uses (the HTTP field's, the
    CLI flag's), so a server names the field at fault from it, never from the message's words."""
    for check, shown in [(lambda: SynthesisParams.create(max_frames=3), "max_frames"),
                         (lambda: check_api_field("max_new_tokens", 3), "max_new_tokens"),
                         (lambda: BY_NAME["max_frames"].check(3, "--max-frames"), "--max-frames")]:
        with pytest.raises(ParamError, match=rf"^{shown} must ") as e:
            check()
        assert e.value.param == "max_frames" and api_name(e.value.param) == "max_new_tokens"
    assert api_name("max_chars") == "max_chars" and api_name("seed") == "seed"


def test_defaults_are_the_dataclass_defaults_and_valid():
    s = SynthesisParams()
    for p in PARAMS:
        assert getattr(s, p.name) == p.default
    assert SynthesisParams.create() == s
    assert SamplingParams().validate() == SamplingParams()


def test_unknown_names_are_a_type_error():
    with pytest.raises(TypeError, match="unknown synthesis parameter.*speed"):
        SynthesisParams.create(speed=1.0)


def test_scene_is_bounded():
    assert SynthesisParams.create(scene="A quiet room.").scene == "A quiet room."
    with pytest.raises(ValueError, match="scene must be at most 2000 characters"):
        SynthesisParams.create(scene="x" * 2001)
    with pytest.raises(ValueError, match="scene must be a string"):
        SynthesisParams.create(scene=3)


@pytest.mark.parametrize("scene,msg", [("", "^scene is empty$"), (" \n ", "^scene is empty$"),
                                       ("\u200b", r"^scene is empty \(only invisible"),
                                       ("[SPEAKER0] A room.", r"^scene contains a \[SPEAKERn\] tag"),
                                       ("A \udcff room.", "^scene is not valid Unicode")])
def test_a_scene_the_prompt_builder_refuses_is_refused_with_the_parameters(scene, msg):
    """It passed the table and failed at the first prompt (after the CLI had loaded the model: `--scene ""`)."""
    with pytest.raises(ValueError, match=msg):
        SynthesisParams.create(scene=scene)


def test_utterances_advance_the_seed():
    p = SynthesisParams.create(seed=2**63 - 1, temperature=0.5)
    assert p.sampling(0).seed == 2**63 - 1 and p.sampling(1).seed == 0
    assert p.sampling(3).temperature == 0.5


def test_cli_options_come_from_the_table():
    parser = argparse.ArgumentParser()
    add_cli_options(parser)
    args = parser.parse_args([])
    for p in PARAMS:
        assert getattr(args, p.name) == p.default
    args = parser.parse_args(["--temperature", "0.7", "--ras-window", "0", "--max-frames", "100"])
    assert (args.temperature, args.ras_window, args.max_frames) == (0.7, 0, 100)
    text = parser.format_help()
    assert "default: 0.95" in text and "(0.0, 1.0]" in text and "--ras-window" in text
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SynthesisParams.create(temperature=parser.parse_args(["--temperature", "inf"]).temperature)
    assert math.isinf(parser.parse_args(["--temperature", "inf"]).temperature)  # argparse parses; the table refuses
