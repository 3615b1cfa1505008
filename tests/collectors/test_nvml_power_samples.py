"""Power swings through the driver's sample buffer (nvmlDeviceGetSamples, NVML_TOTAL_POWER_SAMPLES):
a 1 Hz swing shows at a 10 s interval, each run reads only new samples, and a driver without the
buffer is asked once."""

from __future__ import annotations

import pynvml

from gpumon.collectors.nvml_tables import NOT_FOUND, TOTAL_POWER_SAMPLES, VALUE_MEMBERS
from gpumon.simulate.nvml import FakeNVML
from tests.conftest import gpu_values
from tests.support.nvml import names, rig

SWING = {"gpumon_gpu_power_min_watts", "gpumon_gpu_power_max_watts", "gpumon_gpu_power_mean_watts"}


def test_constants_are_pynvmls() -> None:
    assert TOTAL_POWER_SAMPLES == pynvml.NVML_TOTAL_POWER_SAMPLES
    assert NOT_FOUND == pynvml.NVML_ERROR_NOT_FOUND
    union = [name for name, _ in pynvml.c_nvmlValue_t._fields_]
    assert len(VALUE_MEMBERS) == pynvml.NVML_VALUE_TYPE_COUNT
    for vtype, member in VALUE_MEMBERS.items():
        assert union[vtype] == member   # nvmlValueType_t n names the union's n-th member
    assert VALUE_MEMBERS[pynvml.NVML_VALUE_TYPE_UNSIGNED_INT] == "uiVal"
    assert VALUE_MEMBERS[pynvml.NVML_VALUE_TYPE_DOUBLE] == "dVal"


def test_a_1hz_swing_shows_at_a_10s_interval_while_the_instant_power_does_not() -> None:
    fake, c, _ = rig(count=2)
    fake.set_power_swing(350.0, 700.0, 1.0)
    fake.tick(10)
    first = c.collect()
    assert not names(first) & SWING          # the first read only marks where the interval starts
    instant = []
    for _ in range(3):
        fake.tick(10)
        out = c.collect()
        low, high = gpu_values(out, "gpumon_gpu_power_min_watts"), gpu_values(out, "gpumon_gpu_power_max_watts")
        mean = gpu_values(out, "gpumon_gpu_power_mean_watts")
        assert set(low) == set(high) == set(mean) == {"0", "1"}
        assert 340 <= low["0"] <= 355 and 690 <= high["0"] <= 700, (low, high)
        assert low["0"] < mean["0"] < high["0"]
        instant.append(gpu_values(out, "gpumon_gpu_power_watts")["0"])
    # a reading every 10 s lands on the same phase of a 1 Hz wave: one level, never the swing
    assert max(instant) - min(instant) < 20
    c.close()


def test_each_run_reads_only_the_samples_since_the_previous_one() -> None:
    fake, c, _ = rig(count=1)
    fake.set_power_swing(350.0, 700.0, 1.0)
    fake.tick(10)
    c.collect()
    fake.tick(10)
    c.collect()
    fake.set_power_swing(200.0, 200.0, 1.0)
    fake.tick(10)
    out = c.collect()
    # only this interval's samples: the 350/700 ones before it are not read again
    assert 195 <= gpu_values(out, "gpumon_gpu_power_min_watts")["0"] <= gpu_values(out, "gpumon_gpu_power_max_watts")["0"] <= 200


def test_no_new_sample_is_no_value_and_no_error() -> None:
    fake, c, _ = rig(count=1)
    fake.tick(10)
    c.collect()
    fake.tick(10)
    assert names(c.collect()) >= SWING
    out = c.collect()                     # no time passed: the driver answers NOT_FOUND
    assert not names(out) & SWING
    assert not out.errors
    fake.tick(10)
    assert names(c.collect()) >= SWING    # and it is asked again the next run
    assert fake.gpu_calls[("nvmlDeviceGetSamples", 0)] == 4


def test_a_driver_without_the_sample_buffer_is_asked_once() -> None:
    for code, reason in ((pynvml.NVML_ERROR_NOT_SUPPORTED, "nvml_not_supported"),
                         (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, "nvml_function_not_found")):
        _, control, _ = rig(count=2)
        before = control.collect().errors.get(reason, 0)   # what else the H100 refuses at discovery
        control.close()
        fake, c, _ = rig(count=2)
        fake.fail("nvmlDeviceGetSamples", code)
        out = c.collect()
        assert out.errors.get(reason) == before + 2   # once per GPU
        for _ in range(5):
            fake.tick(10)
            out = c.collect()
            assert not names(out) & SWING and reason not in out.errors
        assert fake.calls["nvmlDeviceGetSamples"] == 2
        assert "gpumon_gpu_power_watts" in names(out)   # the instant power is unaffected
        c.close()


def test_the_double_answers_as_pynvml_does() -> None:
    fake = FakeNVML("a10", 1)
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    try:
        fake.nvmlDeviceGetSamples(h, pynvml.NVML_TOTAL_POWER_SAMPLES, 0)
        raise AssertionError("an empty buffer answers NOT_FOUND")
    except pynvml.NVMLError_NotFound:
        pass
    fake.tick(1)
    vtype, samples = fake.nvmlDeviceGetSamples(h, pynvml.NVML_TOTAL_POWER_SAMPLES, 0)
    assert vtype == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert len(samples) == 50 and all(isinstance(s, pynvml.c_nvmlSample_t) for s in samples)
    stamps = [s.timeStamp for s in samples]
    # 20 ms apart, as a real H100's (driver 580: tests/fixtures/nvml/h100_r580.json)
    assert stamps == sorted(stamps) and stamps[1] - stamps[0] == 20_000   # µs
    assert all(18_000 <= s.sampleValue.uiVal <= 150_000 for s in samples)  # mW, within the A10's range
    _, newer = fake.nvmlDeviceGetSamples(h, pynvml.NVML_TOTAL_POWER_SAMPLES, stamps[9])
    assert [s.timeStamp for s in newer] == stamps[10:]
    fake.tick(3600)
    _, full = fake.nvmlDeviceGetSamples(h, pynvml.NVML_TOTAL_POWER_SAMPLES, 0)
    assert len(full) == 119                # a bounded ring of 2.36 s, like the real driver's
