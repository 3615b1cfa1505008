// gpumon's monitoring mixin: prometheusAlerts, prometheusRules and grafanaDashboards from the shipped
// rule files and dashboards, with _config (config.libsonnet) applied.
local render = import 'lib/render.libsonnet';
local mixin =
  (import 'config.libsonnet') +
  (import 'alerts/alerts.libsonnet') +
  (import 'rules/rules.libsonnet') +
  (import 'dashboards/dashboards.libsonnet');
mixin {
  // Rendering fails if no shipped expression uses the job matcher any more: gpumonSelector would do nothing.
  local uses = render.selectorUses(std.objectValues(super.alertFiles) + std.objectValues(super.recordFiles)),
  assert uses > 0 : 'gpumon mixin: no rule uses %s, so _config.gpumonSelector has no effect' % render.sourceSelector,
  // All rule files by name, rendered: `jsonnet -S -m OUT -e '(import "mixin.libsonnet").ruleFiles'`
  // style rendering of one file per name (see docs/deployment.md).
  ruleFiles:: self.alertFiles + self.recordFiles,
}
