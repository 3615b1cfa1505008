"""Azure Monitor sink volume: bytes, rows and requests per host per day at the default intervals.

Runs the standalone ``bench/azure_volume.py`` (the real collectors on a simulated ND H100 v5 host,
the real sink on a simulated clock, uploading to the loopback ingestion service that validates every
row) and keeps its JSON. ``--intervals`` upload intervals of 60 s are measured and scaled to a day.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.common import HERE, REPO, Options, clean_env, say


def run(opts: Options) -> dict:
    intervals = 2 if opts.smoke else 30
    cmd = [sys.executable, os.path.join(HERE, "azure_volume.py"), "--intervals", str(intervals)]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"azure_volume.py exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    data = json.loads(proc.stdout)
    say(opts, f"azure_volume: {data['requests_per_day']} requests, {data['rows_per_day']} rows, "
              f"{data['json_megabytes_per_day']} MB JSON ({data['wire_bytes_per_day_gzip'] / 1e6:.1f} MB gzip on the "
              f"wire) per host per day at a {data['upload_interval_seconds']:g} s upload interval and "
              f"{data['collect_interval_seconds']:g} s collection; ~${data['usd_per_host_per_month_at_list_price']}"
              f"/host/month at ${data['price_per_gb_usd']}/GB")
    return {"command": "python bench/azure_volume.py --intervals " + str(intervals), **data}
