"""How `epd serve` has the language engine share one host's cores with the vision
side: where they share all of them, its engine steps on half the threads while
its requests await embeddings (--threads-while-encoding), paces its decode steps
meanwhile by the TPOT and TTFT targets (--tpot-slo-ms and --ttft-slo-ms, TPOT_SLO_MS
and TTFT_SLO_MS unless given, or a fixed
--decode-interval-while-encoding-ms), and its OpenMP threads
spin between its operators (GOMP_SPINCOUNT over the stack's PASSIVE), and Triton
runs one request a forward (configs/shared-cpu.pbtxt); where the cores are set
apart, or several language instances share them, none of these."""

from __future__ import annotations

import os
from pathlib import Path

from services.launcher.serve import (
    GOMP_DEFAULT_SPIN_COUNT,
    TPOT_SLO_MS,
    TTFT_SLO_MS,
    Component,
    StackConfig,
    components,
)


def _language(config: StackConfig) -> Component:
    [language] = [p for p in components(config) if p.name.startswith("language")]
    return language


def _triton_config(config: StackConfig) -> str | None:
    [triton] = [p for p in components(config) if p.name == "triton"]
    args = triton.args
    return args[args.index("--model-config-name") + 1] if "--model-config-name" in args else None


def _flag(part: Component, flag: str) -> str | None:
    args = part.args
    return args[args.index(flag) + 1] if flag in args else None


def _threads_flag(part: Component) -> str | None:
    return _flag(part, "--threads-while-encoding")


def _interval_flag(part: Component) -> str | None:
    return _flag(part, "--decode-interval-while-encoding-ms")


def _target_flag(part: Component) -> str | None:
    return _flag(part, "--tpot-slo-ms")


def test_one_language_instance_on_shared_cores_yields_them_while_encoding(tmp_path: Path) -> None:
    language = _language(StackConfig(tmp_path, "m", tmp_path))
    assert _threads_flag(language) == str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert language.spin_count == GOMP_DEFAULT_SPIN_COUNT
    assert _triton_config(StackConfig(tmp_path, "m", tmp_path)) == "shared-cpu"
    assert _target_flag(language) == str(TPOT_SLO_MS) and _interval_flag(language) is None
    assert _flag(language, "--ttft-slo-ms") == str(TTFT_SLO_MS)
    given = _language(
        StackConfig(
            tmp_path, "m", tmp_path, threads_while_encoding=3, decode_interval_while_encoding_ms=7
        )
    )
    assert _threads_flag(given) == "3" and _interval_flag(given) == "7"
    assert _target_flag(given) is None  # a fixed interval overrides the target
    target = _language(StackConfig(tmp_path, "m", tmp_path, tpot_slo_ms=250, ttft_slo_ms=0))
    assert _target_flag(target) == "250" and _flag(target, "--ttft-slo-ms") == "0"


def test_cores_set_apart_or_shared_by_two_language_instances_are_left_alone(
    tmp_path: Path,
) -> None:
    apart = StackConfig(tmp_path, "m", tmp_path, encoder_cpus="0", language_cpus="1")
    for config in (apart, StackConfig(tmp_path, "m", tmp_path, threads_while_encoding=0)):
        language = _language(config)
        assert _threads_flag(language) is None and language.spin_count == 0
    assert _interval_flag(_language(apart)) is None and _target_flag(_language(apart)) is None
    two = StackConfig(tmp_path, "m", tmp_path, num_languages=2)
    for part in components(two):
        if part.name.startswith("language"):
            assert _threads_flag(part) is None and part.spin_count == 0
            assert _interval_flag(part) is None and _target_flag(part) is None
    assert _triton_config(apart) is None and _triton_config(two) is None


def test_the_spin_count_reaches_the_environment_unless_one_is_given(tmp_path: Path) -> None:
    language = _language(StackConfig(tmp_path, "m", tmp_path))
    environment = language.environment({"OMP_WAIT_POLICY": "PASSIVE"})
    assert environment["GOMP_SPINCOUNT"] == str(GOMP_DEFAULT_SPIN_COUNT)
    assert environment["OMP_WAIT_POLICY"] == "PASSIVE"
    assert language.environment({"GOMP_SPINCOUNT": "7"})["GOMP_SPINCOUNT"] == "7"
    triton = next(p for p in components(StackConfig(tmp_path, "m", tmp_path)) if p.name == "triton")
    assert "GOMP_SPINCOUNT" not in triton.environment({"OMP_WAIT_POLICY": "PASSIVE"})
