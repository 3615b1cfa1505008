"""``gpumon job``: the GPUs a Slurm or Kubernetes job holds, asked of Prometheus (no daemon config)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable

from gpumon import logs
from gpumon.cli_commands import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gpumon.config import ConfigError


def cmd_job(args: argparse.Namespace) -> int:
    """``gpumon job``: exit 0 shown; 1 the server could not answer (unreachable, refused, rules not
    loaded); 2 bad usage or a job no GPU is held by."""
    from gpumon.fleet import job as fleet_job
    from gpumon.fleet.promql import AZURE_AUDIENCE, Auth, Client
    from gpumon.report import jobs as job_report

    logs.setup("warning", "text")
    problem = ("give a JOB_ID or --list, not both" if bool(args.job_id) == bool(args.list) else
               "--prometheus URL (or $GPUMON_PROMETHEUS_URL) is required" if not args.prometheus else
               "--bearer-token-file is required with --auth bearer"
               if args.auth == "bearer" and not args.bearer_token_file else
               "--interval must be at least 0.1 s" if args.interval < 0.1 else "")
    if problem:
        print(f"gpumon: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    auth = Auth(args.auth, args.bearer_token_file, args.credential, args.client_id, args.tenant_id,
                os.environ.get("GPUMON_JOB_CLIENT_SECRET", ""), args.audience or AZURE_AUDIENCE)
    try:
        view = fleet_job.JobView(Client(args.prometheus, auth, args.timeout, args.ca_file))
    except ConfigError as exc:   # the credential's settings, named by the flag that gives each
        flag = "$GPUMON_JOB_CLIENT_SECRET" if exc.key == "client_secret" else "--" + exc.key.replace("_", "-")
        print(f"gpumon: error: gpumon job: {flag}: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, OSError, ImportError) as exc:   # bad URL or CA file, no azure-identity
        print(f"gpumon: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def render() -> str:
        if args.list:
            jobs = view.jobs()
            return job_report.jobs_json(jobs) if args.format == "json" else job_report.jobs_table(jobs)
        rows = view.rows(args.job_id)
        return job_report.job_json(rows) if args.format == "json" else job_report.job_table(args.job_id, rows)

    try:
        return _show(args, render, view.client.shown)
    except KeyboardInterrupt:   # Ctrl-C ends --watch (or a slow query)
        return EXIT_OK


def _show(args: argparse.Namespace, render: Callable[[], str], url: str) -> int:
    """Print once, or (``--watch``) redraw every ``--interval`` seconds, errors included, like top."""
    from gpumon.fleet.job import UnknownJob
    from gpumon.fleet.promql import QueryFailed

    done = 0
    while True:
        try:
            text, code = render(), EXIT_OK
        except UnknownJob as exc:
            text, code = f"gpumon: error: {exc}\n", EXIT_USAGE
        except QueryFailed as exc:
            text, code = f"gpumon: error: {exc}\n", EXIT_FAILED
        except ConfigError as exc:
            text, code = f"gpumon: error: {exc}\n", EXIT_USAGE
        if not args.watch:
            (sys.stdout if code == EXIT_OK else sys.stderr).write(text)
            return code
        if args.format == "table":   # like top: home, clear, redraw
            sys.stdout.write(f"\x1b[H\x1b[2J{url}  every {args.interval:g} s  {_clock()}\n{text}")
        else:
            sys.stdout.write(text)
        sys.stdout.flush()
        done += 1
        if args.iterations and done >= args.iterations:
            return code
        threading.Event().wait(args.interval)


def _clock() -> str:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).strftime("%H:%M:%S UTC")
