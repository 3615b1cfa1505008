"""The renderer stays byte-compatible with text 0.0.4 and OpenMetrics, and its cache stays correct."""

from __future__ import annotations

import subprocess

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpumon.model import MetricFamily, MetricSpec, MetricType
from gpumon.render import Renderer, format_value

TEMP = MetricSpec("gpumon_test_temperature_celsius", MetricType.GAUGE, 'Temp with "quotes" \\ and\nnewline',
                  "celsius", ("gpu", "uuid"))
BYTES = MetricSpec("gpumon_test_received_bytes_total", MetricType.COUNTER, "Bytes.", "bytes", ("device",))
INFO = MetricSpec("gpumon_test_info", MetricType.INFO, "Identity.", labels=("model",))


def families(temp: float = 41.5) -> list[MetricFamily]:
    return [
        MetricFamily(TEMP, (TEMP.sample(temp, "0", 'GPU-"x"\\y\nz'), TEMP.sample(38, "1", "GPU-b"))),
        MetricFamily(BYTES, (BYTES.sample(2**53, "mlx5_ib0"),)),
        MetricFamily(INFO, (INFO.sample(1, "NVIDIA H100 80GB HBM3"),)),
    ]


def test_text_round_trips_through_the_reference_parser():
    text = Renderer().render(families())
    parsed = {f.name: f for f in parse_text(text)}
    temp = parsed["gpumon_test_temperature_celsius"]
    assert temp.documentation == 'Temp with "quotes" \\ and\nnewline'
    assert {s.labels["uuid"]: s.value for s in temp.samples} == {'GPU-"x"\\y\nz': 41.5, "GPU-b": 38.0}
    assert parsed["gpumon_test_received_bytes"].type == "counter"
    assert parsed["gpumon_test_received_bytes"].samples[0].value == 2**53


def test_openmetrics_round_trips_with_units_and_eof():
    text = Renderer().render(families(), openmetrics=True)
    assert text.endswith("# EOF\n")
    parsed = {f.name: f for f in parse_openmetrics(text)}
    assert parsed["gpumon_test_received_bytes"].unit == "bytes"
    assert parsed["gpumon_test_temperature_celsius"].unit == "celsius"
    assert parsed["gpumon_test"].type == "info"
    assert parsed["gpumon_test"].samples[0].labels == {"model": "NVIDIA H100 80GB HBM3"}


def test_promtool_check_metrics_is_clean():
    text = Renderer().render(families())
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cached_prefixes_follow_new_values_and_drop_gone_series():
    renderer = Renderer()
    renderer.render(families(41.5))
    second = renderer.render(families(50.25)[:1])
    assert 'gpumon_test_temperature_celsius{gpu="0"' in second and " 50.25\n" in second
    assert "gpumon_test_received_bytes_total" not in second
    assert len(renderer._prefixes) == 2  # only the series of the latest render are kept


def test_value_formatting():
    assert format_value(1.0) == "1"
    assert format_value(0.25) == "0.25"
    assert format_value(float("nan")) == "NaN"
    assert format_value(float("inf")) == "+Inf"
    assert format_value(float("-inf")) == "-Inf"
    assert float(format_value(1e20)) == 1e20
