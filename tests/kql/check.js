// Parses KQL queries against Log Analytics table schemas with the Kusto language service and prints
// the diagnostics. Input (stdin, JSON): {"tables": {"Name": [["Column", "type"], ...]},
// "queries": {"id": "kql", ...}}. Output (stdout, JSON): {"id": ["error message at offset", ...]}.
'use strict';
const path = require('path');
const fs = require('fs');

const dir = path.join(__dirname, 'node_modules', '@kusto', 'language-service-next');
global.Bridge = require(path.join(dir, 'bridge.min.js'));
require(path.join(dir, 'Kusto.Language.Bridge.min.js'));
/* global Kusto */
const K = Kusto.Language;
const S = K.Symbols;

const input = JSON.parse(fs.readFileSync(0, 'utf8'));
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
process.stdout.write(JSON.stringify(out));
