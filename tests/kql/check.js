// Parses KQL queries against Log Analytics table schemas with the Kusto language service and prints
// the diagnostics. Input (stdin): one request a line, JSON {"tables": {"Name": [["Column", "type"], ...]},
// "queries": {"id": "kql", ...}}. Output (stdout): one answer a line, in order, JSON
// {"id": ["error message at offset", ...]}. Loading the language service takes seconds, so one process
// answers every request of a test module.
'use strict';
const path = require('path');

const dir = path.join(__dirname, 'node_modules', '@kusto', 'language-service-next');
global.Bridge = require(path.join(dir, 'bridge.min.js'));
require(path.join(dir, 'Kusto.Language.Bridge.min.js'));
/* global Kusto */
const K = Kusto.Language;
const S = K.Symbols;

function analyse(input) {
  const tables = Object.entries(input.tables).map(([name, columns]) =>
    new S.TableSymbol.$ctor7(name, '(' + columns.map(([c, t]) => `${c}:${t}`).join(', ') + ')', null));
  const globals = K.GlobalState.Default.WithDatabase(new S.DatabaseSymbol.$ctor2('workspace', null, tables));
  const out = {};
  for (const [id, text] of Object.entries(input.queries)) {
    const code = K.KustoCode.ParseAndAnalyze(text, globals);
    const diagnostics = code.GetDiagnostics();
    const messages = [];
    for (let i = 0; i < diagnostics.Count; i++) {
      const d = diagnostics.getItem(i);
      if (d.Severity === 'Error') {
        messages.push(`${d.Message} (at ${d.Start}: ${JSON.stringify(text.substr(d.Start, Math.max(d.Length, 1)))})`);
      }
    }
    out[id] = messages;
  }
  return out;
}

const lines = require('readline').createInterface({ input: process.stdin, terminal: false });
lines.on('line', (line) => {
  if (line.trim()) {
    process.stdout.write(JSON.stringify(analyse(JSON.parse(line))) + '\n');
  }
});
