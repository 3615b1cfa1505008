"""The nvml collector's field values: one ``nvmlDeviceGetFieldValues`` call per GPU per run for
every value with a field id (the slow ones every SLOW_FIELD_SECONDS), wrapping counters made totals,
and the NVLink per-link values summed into GPU totals."""

from __future__ import annotations

from gpumon.cadence import due
from gpumon.catalogue import gpu as CG
from gpumon.collectors import nvml_readings as M
from gpumon.collectors.nvml_gpu import Gpu, GpuReader, code_error, field_value
from gpumon.model import Collection


class FieldReader(GpuReader):
    """Reads a GPU's fields. ``_nvlink_totals_per_link``: UUIDs of GPUs whose links answered
    different NVLink error totals: the driver reads those fields per link (scopeId), so the GPU total
    is their sum (see ``_nvlink_rows``)."""

    _nvlink_totals_per_link: set[str]

    def _field_plan(self, gpu: Gpu, slow_due: bool) -> list[tuple[int, int]]:
        driver = self.session.driver_major
        ids = [(fs.field_id, 0) for fs in M.FIELDS if fs.min_driver <= driver and (slow_due or not fs.slow)]
        if gpu.link_count:
            per_link = [M.FIELD_NVLINK_STATE, M.FIELD_NVLINK_TX_KIB, M.FIELD_NVLINK_RX_KIB]
            per_link += [fs.field_id for fs in M.NVLINK_TOTAL_FIELDS]
            if self.settings.nvlink_per_link:
                per_link += [fid for fid, _ in M.NVLINK_LINK_ERROR_FIELDS]
            ids += [(fid, link) for link in range(gpu.link_count) for fid in per_link]
        return [key for key in ids if ("field",) + key not in gpu.dropped]

    def _fields(self, gpu: Gpu, now: float, rows: list[M.Row], out: Collection) -> bool:
        """One nvmlDeviceGetFieldValues call for every field-backed value; False when none was asked.
        The slow fields are in it once every SLOW_FIELD_SECONDS; between, their last rows stand in."""
        if ("call", "fields") in gpu.dropped:
            return False
        slow_due = due(gpu.slow_fields_at, now, M.SLOW_FIELD_SECONDS)
        plan = self._field_plan(gpu, slow_due)
        if not plan:
            return False
        try:
            values = self.session.call("nvmlDeviceGetFieldValues", gpu.dev.handle,
                                       [(fid, scope) for fid, scope in plan])
        except Exception as exc:  # noqa: BLE001 - every NVML error has an outcome
            self._handle_error(gpu, ("call", "fields"), "nvmlDeviceGetFieldValues", exc, out)
            if ("call", "fields") in gpu.dropped:
                # the whole call is unavailable: every field falls back to its call, if it has one
                for fs in M.FIELDS:
                    gpu.dropped.setdefault(("field", fs.field_id, 0), self._clock())
            return True
        got: dict[tuple[int, int], float] = {}
        for (fid, scope), fv in zip(plan, values):
            ret = int(fv.nvmlReturn)
            if ret != 0:
                err = code_error(ret)
                self._handle_error(gpu, ("field", fid, scope), f"field {fid} (scope {scope})", err, out)
                continue
            got[(fid, scope)] = field_value(fv)
        fresh_slow: list[M.Row] = []
        for fs in M.FIELDS:
            if (fs.field_id, 0) in got:
                value = got[(fs.field_id, 0)]
                if fs.wraps:
                    value = self._unwrap(gpu, fs, value)
                row = (fs.spec, fs.extra, value * fs.scale)
                (fresh_slow if fs.slow else rows).append(row)
        if slow_due:
            gpu.slow_field_rows = fresh_slow
            # a slow field that failed this time (and was not dropped) is asked again next run
            if all(key in got for key in plan if key[1] == 0 and key[0] in M.SLOW_FIELD_IDS):
                gpu.slow_fields_at = now
        rows.extend(gpu.slow_field_rows)
        if gpu.link_count:
            self._nvlink_rows(gpu, got, rows)
        return True

    @staticmethod
    def _unwrap(gpu: Gpu, fs: M.FieldSpec, raw: float) -> float:
        """A total that only grows from a counter that wraps at ``fs.wraps``: right while the counter
        wraps at most once between two reads (the docs say what that means for PCIe bytes)."""
        last = gpu.unwrapped.get(fs.field_id)
        total = raw if last is None else last[1] + (raw - last[0]) % fs.wraps
        gpu.unwrapped[fs.field_id] = (raw, total)
        return total

    @staticmethod
    def _all_links(gpu: Gpu, got: dict[tuple[int, int], float], fid: int) -> list[float] | None:
        """The per-link values of a field, or None unless every link not dropped answered: a total
        over some links only would look like a counter reset."""
        vals = [got[(fid, link)] for link in range(gpu.link_count) if (fid, link) in got]
        asked = sum(1 for link in range(gpu.link_count) if ("field", fid, link) not in gpu.dropped)
        return vals if vals and len(vals) == asked else None

    def _nvlink_rows(self, gpu: Gpu, got: dict[tuple[int, int], float], rows: list[M.Row]) -> None:
        links = range(gpu.link_count)
        states = [got.get((M.FIELD_NVLINK_STATE, link)) for link in links]
        known = [s for s in states if s is not None]
        if known:
            rows.append((CG.NVLINK_ACTIVE, (), float(sum(1 for s in known if s == 1))))
        for fid, direction in ((M.FIELD_NVLINK_TX_KIB, "tx"), (M.FIELD_NVLINK_RX_KIB, "rx")):
            vals = self._all_links(gpu, got, fid)
            if vals is not None:
                rows.append((CG.NVLINK_BYTES, (direction,), sum(vals) * 1024.0))
        totals = {fs: self._all_links(gpu, got, fs.field_id) for fs in M.NVLINK_TOTAL_FIELDS}
        if any(vals and len(set(vals)) > 1 for vals in totals.values()):
            self._nvlink_totals_per_link.add(gpu.dev.uuid)
        per_link = gpu.dev.uuid in self._nvlink_totals_per_link
        for fs, vals in totals.items():
            if vals is None:
                continue
            # Every link answering the same count would mean a driver that ignores scopeId and gives
            # the GPU total each time; summing would multiply it. Once two links differ the values are
            # per link for good (the switch only ever makes the counter jump up, never back).
            total = sum(vals) if per_link else vals[0]
            rows.append((fs.spec, fs.extra, total * fs.scale))
        if not self.settings.nvlink_per_link:
            return
        for link in links:
            lk = str(link)
            if states[link] is not None:
                rows.append((CG.NVLINK_LINK_UP, (lk,), 1.0 if states[link] == 1 else 0.0))
            for fid, kind in M.NVLINK_LINK_ERROR_FIELDS:
                if (fid, link) in got:
                    rows.append((CG.NVLINK_LINK_ERRORS, (lk, kind), got[(fid, link)]))
            for fid, direction in ((M.FIELD_NVLINK_TX_KIB, "tx"), (M.FIELD_NVLINK_RX_KIB, "rx")):
                if (fid, link) in got:
                    rows.append((CG.NVLINK_LINK_BYTES, (lk, direction), got[(fid, link)] * 1024.0))
