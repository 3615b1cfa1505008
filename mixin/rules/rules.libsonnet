// prometheusRules: the groups of the shipped rule files that hold only recording rules.
local files = import 'files.libsonnet';
local render = import '../lib/render.libsonnet';
{
  recordFiles:: {
    [name]: render.ruleFile(std.parseYaml(files[name]), $._config)
    for name in std.objectFields(files)
  },
  prometheusRules+:: {
    groups+: std.flattenArrays([$.recordFiles[name].groups for name in std.objectFields($.recordFiles)]),
  },
}
