// prometheusAlerts: the groups of every shipped rule file that holds an alert. A group keeps its
// recording rules next to its alerts (job-rules.yaml's alerts read the records of their own group),
// so groups are never split between prometheusAlerts and prometheusRules.
local files = import 'files.libsonnet';
local render = import '../lib/render.libsonnet';
{
  // Each file's name and its rendered document (the mixin's tests compare them to deploy/prometheus/).
  alertFiles:: {
    [name]: render.ruleFile(std.parseYaml(files[name]), $._config)
    for name in std.objectFields(files)
  },
  prometheusAlerts+:: {
    groups+: std.flattenArrays([$.alertFiles[name].groups for name in std.objectFields($.alertFiles)]),
  },
}
