// Applies _config to the shipped rules and dashboards. Every substitution checks that the text it
// replaces is where it expects, so a change to a shipped file that moves a threshold or the job
// matcher fails the render instead of leaving a _config key without effect.
{
  // The job matcher the shipped files use, which _config.gpumonSelector replaces.
  sourceSelector:: 'job=~"gpumon.*"',

  // alert name -> the _config key of its threshold, and the comparison and literal the shipped file has.
  thresholds:: {
    GpumonGpuThermalSlowdown: { key: 'gpuSlowdownRatio', op: '>', source: '0.5' },
    GpumonGpuPowerBrake: { key: 'gpuSlowdownRatio', op: '>', source: '0.5' },
    GpumonIBPortErrorsHigh: { key: 'ibPortErrorsPerSecond', op: '>', source: '0.1' },
    GpumonGpuPowerSwing: { key: 'powerSwingRatio', op: '>', source: '0.6' },
    GpumonJobStraggler: { key: 'jobStragglerScore', op: '>', source: '5' },
    GpumonGpuRemapTableFilling: { key: 'remapTableRows', op: '>=', source: '64' },
  },

  // How often old occurs in text (std.split: std.findSubstr is quadratic in the C++ jsonnet).
  count(text, old):: std.length(std.split(text, old)) - 1,

  replaceOnce(text, old, new, where)::
    local found = $.count(text, old);
    assert found == 1 : 'gpumon mixin: %s: expected "%s" once in its expression, found it %d times' % [where, old, found];
    std.strReplace(text, old, new),

  // A threshold as PromQL writes it: %g (std.toString gives 0.10000000000000001); a string as it is.
  number(value):: if std.isString(value) then value else '%g' % value,

  // One rule with the selector and, for an alert in the table, its threshold from config.
  rule(rule, config)::
    local name = if std.objectHas(rule, 'alert') then rule.alert else rule.record;
    local selected = std.strReplace(rule.expr, $.sourceSelector, config.gpumonSelector);
    local t = if std.objectHas(rule, 'alert') && std.objectHas($.thresholds, rule.alert) then $.thresholds[rule.alert];
    local expr =
      if t == null then selected
      else $.replaceOnce(selected, ' %s %s' % [t.op, t.source], ' %s %s' % [t.op, $.number(config[t.key])], name);
    rule { expr: expr },

  // A rule file's document with every rule rendered.
  ruleFile(document, config):: document {
    groups: [group { rules: [$.rule(r, config) for r in group.rules] } for group in document.groups],
  },

  // How many expressions in these documents use the shipped job matcher.
  selectorUses(documents)::
    std.length([1 for d in documents for g in d.groups for r in g.rules
                if $.count(r.expr, $.sourceSelector) > 0]),

  // Each string field named "expr" (a panel's query) with the job matcher from config.
  dashboard(value, config)::
    if std.isObject(value) then {
      [k]: if k == 'expr' && std.isString(value[k])
      then std.strReplace(value[k], $.sourceSelector, config.gpumonSelector)
      else $.dashboard(value[k], config)
      for k in std.objectFields(value)
    }
    else if std.isArray(value) then [$.dashboard(v, config) for v in value]
    else value,
}
