// gpumon's monitoring mixin: prometheusAlerts, prometheusRules and grafanaDashboards from the shipped
// rule files and dashboards, with _config (config.libsonnet) applied.
local render = import 'lib/render.libsonnet';
local sources = (import 'alerts/files.libsonnet') + (import 'rules/files.libsonnet');
local mixin =
  (import 'config.libsonnet') +
  (import 'alerts/alerts.libsonnet') +
  (import 'rules/rules.libsonnet') +
  (import 'dashboards/dashboards.libsonnet');
mixin {
  // Rendering fails if no shipped expression uses the job matcher any more: gpumonSelector would do nothing.
  local uses = render.selectorUses([std.parseYaml(text) for text in std.objectValues(sources)]),
  assert uses > 0 : 'gpumon mixin: no rule uses %s, so _config.gpumonSelector has no effect' % render.sourceSelector,
  // Every rule file by name, rendered (the tests compare them with deploy/prometheus/).
  ruleFiles:: self.alertFiles + self.recordFiles,
}
