// What a user of the mixin may change. The defaults render the shipped files exactly
// (deploy/prometheus/*.yaml and dashboards/grafana/*.json); docs/deployment.md lists each key.
{
  _config+:: {
    // PromQL label matcher for gpumon's scrape job: replaces job=~"gpumon.*" wherever the rules and
    // dashboards select the job (GpumonExporterDown, GpumonExporterAbsent, the fleet's "Hosts down").
    // gpumon's own series need no job matcher: their names are gpumon's.
    gpumonSelector: 'job=~"gpumon.*"',

    // Alert thresholds (the literal after the comparison in each alert's expression).
    gpuSlowdownRatio: 0.5,  // GpumonGpuThermalSlowdown, GpumonGpuPowerBrake: share of 10 min throttled
    ibPortErrorsPerSecond: 0.1,  // GpumonIBPortErrorsHigh: port:gpumon_ib_errors:rate5m
    powerSwingRatio: 0.6,  // GpumonGpuPowerSwing: min over 10 min of gpu:gpumon_power_swing:ratio
    jobStragglerScore: 5,  // GpumonJobStraggler: max without (shard) (gpumon_job:straggler_score)
    remapTableRows: 64,  // GpumonGpuRemapTableFilling: rows remapped in 14 days, as predicted
  },
}
