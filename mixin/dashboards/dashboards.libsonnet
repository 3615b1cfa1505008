// grafanaDashboards: the shipped dashboards by file name, with the job matcher from _config.
local files = import 'files.libsonnet';
local render = import '../lib/render.libsonnet';
{
  grafanaDashboards+:: {
    [name]: render.dashboard(files[name], $._config)
    for name in std.objectFields(files)
  },
}
