/// <reference types="node" />
/**
 * Python and TypeScript agree: the state schema (keys, types, array dtypes and shapes), the
 * MIME type and version, the colour map and the escaping rule on every code point.
 *
 * The Python side comes from `tests/_contract.py`: the file named by $PIPATCH_CONTRACT
 * (tests/unit/test_views.py runs this test that way), otherwise its output, run with
 * $PIPATCH_PYTHON, the checkout's .venv/bin/python, or python3.
 */
import { execFileSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { beforeAll, describe, expect, it } from 'vitest';
import { DEFAULT_TOP, circuitEdges, defaultTop, isCircuit } from '../circuit';
import { arrayProblems, normalizeState, selectMatrix, type Mode } from '../data';
import {
  DIVERGING_STOPS,
  ESCAPED,
  NAN_RGB,
  SEQUENTIAL_STOPS,
  divergingColor,
  doneSpan,
  escapeLabel,
  scaleColor,
  scaleKind,
  scaleRange,
  strength,
  truncateLabel,
  type ScaleKind,
} from '../format';
import { documentToState } from '../mime';
import {
  ARRAY_DTYPE,
  ARRAY_SCHEMA,
  CHECK_SCHEMA,
  CIRCUIT_SCHEMA,
  DETAIL_SCHEMA,
  FAITHFULNESS_SCHEMA,
  FEATURE_GRAPH_SCHEMA,
  FEDGE_SCHEMA,
  FNODE_SCHEMA,
  GROUP_SCHEMA,
  NODE_SCHEMA,
  DOCUMENT_SCHEMA,
  MIME_TYPE,
  SCHEMA_VERSION,
  SELECTION_SCHEMA,
  STATE_SCHEMA,
  TOP_SCHEMA,
  UI_SCHEMA,
} from '../schema';

type Json = Record<string, unknown>;
interface Contract {
  mime_type: string;
  schema_version: number;
  schemas: Record<string, Record<string, string>>;
  array_dtype: string;
  arrays: Record<string, string[]>;
  colors: {
    stops: string[];
    nan: number[];
    samples: [number, number, number[]][];
    sequential_stops: string[];
    scaled: [number, ScaleKind, number, number, number[], number][];
  };
  escape: {
    unicode: string;
    escaped: [number, number][];
    unassigned: [number, number][];
    labels: [string, string][];
    truncated: [string, number, string][];
  };
  examples: {
    document: Json;
    live: Json;
    widget: Json;
    ui: Json;
    details: Json[];
    comparison: Json;
    circuit: Json;
    circuit_edges: [number, number, number][];
    circuit_top: number;
    circuit_default_top: [Json, number][];
    scales: [Json, Mode, ScaleKind, number, number][];
    lens_subject: number[];
  };
}

const ROOT = process.cwd(); // vitest runs in the checkout's root (npm test, tests/unit/test_views.py)

function loadContract(): Contract {
  const file = process.env.PIPATCH_CONTRACT;
  if (file) return JSON.parse(readFileSync(file, 'utf8')) as Contract;
  const venv = join(ROOT, '.venv', 'bin', 'python');
  const python = process.env.PIPATCH_PYTHON || (existsSync(venv) ? venv : 'python3');
  const out = execFileSync(python, [join(ROOT, 'tests', '_contract.py')], {
    cwd: ROOT,
    encoding: 'utf8',
    maxBuffer: 256 * 1024 * 1024,
    timeout: 240_000,
  });
  return JSON.parse(out) as Contract;
}

let C: Contract;
beforeAll(() => {
  C = loadContract();
}, 300_000);

/** Whether a JSON value (as the kernel sent it) has schema type `type`. */
function hasType(type: string, v: unknown): boolean {
  const isObj = (x: unknown): x is Json => !!x && typeof x === 'object' && !Array.isArray(x);
  const isInt = (x: unknown) => typeof x === 'number' && Number.isInteger(x);
  switch (type) {
    case 'str':
      return typeof v === 'string';
    case 'str[]':
      return Array.isArray(v) && v.every((x) => typeof x === 'string');
    case 'int':
      return isInt(v);
    case 'int?':
      return v === null || isInt(v);
    case 'int[]':
      return Array.isArray(v) && v.every(isInt);
    case 'float':
      return typeof v === 'number';
    case 'float[]':
      return Array.isArray(v) && v.every((x) => typeof x === 'number');
    case 'float?':
      return v === null || typeof v === 'number';
    case 'float?[]':
      return Array.isArray(v) && v.every((x) => x === null || typeof x === 'number');
    case 'bool':
      return typeof v === 'boolean';
    case '{str: int}':
      return isObj(v) && Object.values(v).every(isInt);
    case '{str: float?}':
      return isObj(v) && Object.values(v).every((x) => x === null || typeof x === 'number');
    case '{str: str[]}':
      return isObj(v) && Object.values(v).every((x) => hasType('str[]', x));
    case 'arrays':
      return isObj(v) && Object.values(v).every((a) => isObj(a) && typeof a.data === 'string' && Array.isArray(a.shape));
    case 'detail':
      return conforms(DETAIL_SCHEMA, v, false);
    case 'top[]':
      return Array.isArray(v) && v.every((t) => conforms(TOP_SCHEMA, t, true));
    case 'selection':
      return isObj(v) && (Object.keys(v).length === 0 || conforms(SELECTION_SCHEMA, v, true));
    case 'circuit':
      return conforms(CIRCUIT_SCHEMA, v, false);
    case 'node[]':
      return Array.isArray(v) && v.every((n) => conforms(NODE_SCHEMA, n, true));
    case 'check[]':
      return Array.isArray(v) && v.every((c) => conforms(CHECK_SCHEMA, c, true));
    case 'faithfulness':
      return conforms(FAITHFULNESS_SCHEMA, v, true);
    case 'feature_graph':
      return conforms(FEATURE_GRAPH_SCHEMA, v, false);
    case 'fnode[]':
      return Array.isArray(v) && v.every((n) => conforms(FNODE_SCHEMA, n, true));
    case 'fedge[]':
      return Array.isArray(v) && v.every((e) => conforms(FEDGE_SCHEMA, e, true));
    case 'group[]':
      return Array.isArray(v) && v.every((g) => conforms(GROUP_SCHEMA, g, true));
    case 'ui':
      return isObj(v) && Object.entries(v).every(([k, x]) => k in UI_SCHEMA && hasType((UI_SCHEMA as Json)[k] as string, x));
    default:
      throw new Error(`unknown schema type ${type}`);
  }
}

/** Every key of `v` is in `schema` with its type; `all`: every key of `schema` is there. */
function conforms(schema: Record<string, string>, v: unknown, all: boolean): boolean {
  if (!v || typeof v !== 'object' || Array.isArray(v)) return false;
  const o = v as Json;
  if (all && !Object.keys(schema).every((k) => k in o)) return false;
  return Object.entries(o).every(([k, x]) => k in schema && hasType(schema[k], x));
}

function inRanges(ranges: [number, number][]): Uint8Array {
  const out = new Uint8Array(0x110000);
  for (const [lo, hi] of ranges) out.fill(1, lo, hi + 1);
  return out;
}

describe('state schema', () => {
  it('is the same in Python and TypeScript', () => {
    expect(MIME_TYPE).toBe(C.mime_type);
    expect(SCHEMA_VERSION).toBe(C.schema_version);
    expect(STATE_SCHEMA).toEqual(C.schemas.state);
    expect(DETAIL_SCHEMA).toEqual(C.schemas.detail);
    expect(TOP_SCHEMA).toEqual(C.schemas.top);
    expect(UI_SCHEMA).toEqual(C.schemas.ui);
    expect(SELECTION_SCHEMA).toEqual(C.schemas.selection);
    expect(DOCUMENT_SCHEMA).toEqual(C.schemas.document);
    expect(CIRCUIT_SCHEMA).toEqual(C.schemas.circuit);
    expect(NODE_SCHEMA).toEqual(C.schemas.node);
    expect(CHECK_SCHEMA).toEqual(C.schemas.check);
    expect(FAITHFULNESS_SCHEMA).toEqual(C.schemas.faithfulness);
    expect(FEATURE_GRAPH_SCHEMA).toEqual(C.schemas.feature_graph);
    expect(FNODE_SCHEMA).toEqual(C.schemas.fnode);
    expect(FEDGE_SCHEMA).toEqual(C.schemas.fedge);
    expect(GROUP_SCHEMA).toEqual(C.schemas.group);
    expect(ARRAY_DTYPE).toBe(C.array_dtype);
    expect(ARRAY_SCHEMA).toEqual(C.arrays);
  });

  it("holds every key of a result's document, each in its type, arrays in their dtype and shape", () => {
    const doc = C.examples.document;
    const stateKeys = Object.keys(STATE_SCHEMA).filter((k) => k !== 'detail');
    const docKeys = Object.keys(DOCUMENT_SCHEMA).filter((k) => k in doc);
    expect(Object.keys(doc).sort()).toEqual([...stateKeys, ...docKeys].sort());
    for (const [key, value] of Object.entries(doc)) {
      const type = (STATE_SCHEMA as Json)[key] ?? (DOCUMENT_SCHEMA as Json)[key];
      expect(hasType(type as string, value), `${key}: ${JSON.stringify(value)?.slice(0, 80)}`).toBe(true);
    }
    const errors: string[] = [];
    const { state } = documentToState(doc);
    const again = normalizeState(doc, errors);
    expect(errors).toEqual([]);
    expect(arrayProblems(state, doc)).toEqual([]);
    // Every array of the kind the schema names, for every view, decoded in its shape.
    const dims: Record<string, number> = { rows: state.row_labels.length, cols: state.col_labels.length, seeds: state.n_seeds };
    const names = Object.keys(state.arrays).sort();
    const expected = state.views.flatMap((v) => Object.keys(ARRAY_SCHEMA).map((what) => `${v}/${what}`)).filter((n) => names.includes(n));
    expect(names).toEqual(expected.sort());
    expect(names.filter((n) => n.endsWith('/verified'))).toEqual(['resid/verified']);
    for (const [name, a] of Object.entries(again.arrays)) {
      const what = name.slice(name.lastIndexOf('/') + 1) as keyof typeof ARRAY_SCHEMA;
      expect(a.shape, name).toEqual(ARRAY_SCHEMA[what].map((d) => dims[d]));
      expect(a.data.length).toBe(a.shape.reduce((x, y) => x * y, 1));
    }
    // Text arrived as the kernel sent it: lone surrogates already U+FFFD, the rest as written.
    expect(state.col_labels).toEqual(['The', ' Eiffel\uFFFD', '\u202E', ' of']);
    expect(state.message).toBe('stopped \uFFFD');
    expect(state.rows_done).toEqual({ resid: 3, mlp: 2 });
    expect(state.row_order).toEqual({ mlp: -1 });
    expect(Number.isNaN(state.arrays['resid/mean'].data[0])).toBe(true);
  });

  it("holds a live state and a widget's traits after a click, each in its type", () => {
    for (const [which, value] of [['live', C.examples.live], ['widget', C.examples.widget]] as const) {
      for (const [key, x] of Object.entries(value)) {
        expect(key in STATE_SCHEMA, `${which}: ${key}`).toBe(true);
        expect(hasType((STATE_SCHEMA as Json)[key] as string, x), `${which}.${key}`).toBe(true);
      }
      const errors: string[] = [];
      normalizeState(value, errors);
      expect(errors).toEqual([]);
    }
    expect(Object.keys(C.examples.widget).sort()).toEqual(Object.keys(STATE_SCHEMA).sort());
    expect(Object.keys(C.examples.live).sort()).toEqual(Object.keys(STATE_SCHEMA).filter((k) => k !== 'detail').sort());
    expect(conforms(UI_SCHEMA, C.examples.ui, true)).toBe(true);
    for (const d of C.examples.details) expect(conforms(DETAIL_SCHEMA, d, false), JSON.stringify(d)).toBe(true);
    const state = normalizeState(C.examples.widget);
    expect(state.detail.top?.map((t) => t.token)).toEqual(['\uFFFD x', ' Paris']);
    expect(Number.isNaN(state.detail.top?.[1].prob)).toBe(true);
    expect(normalizeState({ detail: C.examples.details[1] }).detail.error).toContain('top-5 needs');
  });
});

describe('a comparison', () => {
  it("is read through the same schema: both sides named, a − b and each side's values in their shape", () => {
    const doc = C.examples.comparison;
    const errors: string[] = [];
    const { state } = documentToState(doc);
    normalizeState(doc, errors);
    expect(errors).toEqual([]);
    expect(arrayProblems(state, doc)).toEqual([]);
    expect(state.kind).toBe('compare');
    expect(state.compared).toBe('recovery');
    expect(state.sides.map((s) => s.slice(0, 3))).toEqual(['a: ', 'b: ']);
    expect(Object.keys(state.arrays).sort()).toEqual(['mlp/a', 'mlp/b', 'mlp/mean', 'resid/a', 'resid/b', 'resid/mean']);
    const [diff, a, b] = ['mean', 'a', 'b'].map((what) => state.arrays[`resid/${what}`].data);
    for (let i = 0; i < diff.length; i++) {
      if (Number.isFinite(diff[i])) expect(diff[i]).toBeCloseTo(a[i] - b[i], 6);
    }
  });
});

describe('a circuit', () => {
  it('is read through the same schema: its graph, checks and faithfulness curve in their types', () => {
    const doc = C.examples.circuit;
    for (const [key, value] of Object.entries(doc)) {
      const type = (STATE_SCHEMA as Json)[key] ?? (DOCUMENT_SCHEMA as Json)[key];
      expect(hasType(type as string, value), `${key}: ${JSON.stringify(value)?.slice(0, 80)}`).toBe(true);
    }
    const errors: string[] = [];
    const { state } = documentToState(doc);
    normalizeState(doc, errors);
    expect(errors).toEqual([]);
    expect(isCircuit(state)).toBe(true);
    expect(isCircuit(documentToState(C.examples.document).state)).toBe(false);
    const c = state.circuit;
    expect(c.nodes!.map((n) => n.name)).toEqual(['emb', '0.0', '0.1', 'mlp0', '1.0', '1.1', 'mlp1', 'logits']);
    expect(c.senders!.length).toBe(state.col_labels.length);
    expect(c.receivers!.length).toBe(state.row_labels.length);
    expect(c.ports!.length).toBe(state.row_labels.length);
    // A head's q, k, v are its node's three ports, left to right.
    const q = state.row_labels.indexOf('1.0.q');
    expect(c.receivers!.slice(q, q + 3)).toEqual([4, 4, 4]);
    expect(c.ports![q]).toBeLessThan(c.ports![q + 1]);
    expect(c.ports![q + 1]).toBeLessThan(c.ports![q + 2]);
    expect(c.checked!.map((x) => [state.col_labels[x.col], state.row_labels[x.row]])).toEqual([['emb', 'logits'], ['0.0', 'logits']]);
    expect(c.checked![0].exact).toBeCloseTo(0.45);
    expect(Number.isNaN(c.checked![1].exact)).toBe(true);
    const f = c.faithfulness!;
    expect(f.sizes).toEqual([0, 1, 3, 10, 30]);
    expect(Number.isNaN(f.recovery[2])).toBe(true);
    expect(Number.isNaN(f.size)).toBe(true);
    expect(f.share).toBe(0.8);
  });

  it('ranks its edges as Python does: the same order, the same scores', () => {
    const { state } = documentToState(C.examples.circuit);
    const edges = circuitEdges(state);
    expect(edges.map((e) => [e.row, e.col])).toEqual(C.examples.circuit_edges.map(([r, col]) => [r, col]));
    edges.forEach((e, i) => expect(e.score).toBe(C.examples.circuit_edges[i][2]));
    // The tie (emb → logits +0.5, 0.0 → logits −0.5) in row-major order; the exact value rides along.
    const last = state.row_labels.length - 1;
    expect(edges.slice(0, 2).map((e) => [e.row, e.col])).toEqual([[last, 0], [last, 1]]);
    expect(edges[0].exact).toBeCloseTo(0.45);
    // The browser starts with as many edges as the static figure draws: the faithful circuit's, else DEFAULT_TOP.
    expect(DEFAULT_TOP).toBe(C.examples.circuit_top);
    for (const [doc, top] of C.examples.circuit_default_top) expect(defaultTop(documentToState(doc).state)).toBe(top);
    expect(C.examples.circuit_default_top.map(([, top]) => top)).toEqual([DEFAULT_TOP, 10]);
  });
});

describe('colour map', () => {
  it('has the same stops and gives the same colour for the same value', () => {
    expect([...DIVERGING_STOPS]).toEqual(C.colors.stops);
    expect(NAN_RGB).toEqual(C.colors.nan);
    for (const [v, vmax, rgb] of C.colors.samples) expect(divergingColor(v, vmax), `${v} / ${vmax}`).toEqual(rgb);
  });

  it('has the same sequential stops and gives the same colour and strength on the sequential and rank scales', () => {
    expect([...SEQUENTIAL_STOPS]).toEqual(C.colors.sequential_stops);
    expect(C.colors.scaled.length).toBeGreaterThan(100);
    for (const [v, kind, lo, hi, rgb, t] of C.colors.scaled) {
      expect(scaleColor(v, kind, lo, hi), `${v} on ${kind} [${lo}, ${hi}]`).toEqual(rgb);
      expect(strength(v, kind, lo, hi)).toBeCloseTo(t, 12);
    }
  });

  it('picks the same scale and range for the same state and mode', () => {
    const kinds = C.examples.scales.map(([, mode, kind]) => `${mode}:${kind}`);
    expect(kinds).toEqual(['recovery:diverging', 'raw:diverging', 'recovery:rank', 'raw:rank', 'recovery:sequential', 'raw:sequential']);
    for (const [doc, mode, kind, lo, hi] of C.examples.scales) {
      const { state } = documentToState(doc);
      const view = state.views[0];
      const m = selectMatrix(state, view, -1, mode);
      expect(scaleKind(state, mode)).toBe(kind);
      const [jsLo, jsHi] = scaleRange(state, view, mode, m, doneSpan(state, view, m.rows));
      expect(jsLo).toBeCloseTo(lo, 6);
      expect(jsHi).toBeCloseTo(hi, 6);
    }
  });

  it("draws the lens's rank 0 in the strongest colour and its worst rank in the palest, as Python does", () => {
    const [doc, mode, kind, lo, hi] = C.examples.scales[2];
    const { state } = documentToState(doc);
    expect(state.metric).toBe('rank');
    expect(state.subject).toEqual(C.examples.lens_subject);
    expect(state.subject).toEqual([1]);
    const m = selectMatrix(state, 'resid', -1, mode);
    const darkest = C.colors.sequential_stops[C.colors.sequential_stops.length - 1];
    const palest = C.colors.sequential_stops[0];
    const hex = (rgb: number[]) => `#${rgb.map((x) => x.toString(16).padStart(2, '0')).join('')}`;
    const values = Array.from(m.data!);
    expect(hex(scaleColor(0, kind, lo, hi))).toBe(darkest);
    expect(hex(scaleColor(Math.max(...values), kind, lo, hi))).toBe(palest);
    // Better ranks are darker: the colours' brightness falls as the rank falls.
    const bright = (v: number) => scaleColor(v, kind, lo, hi).reduce((a, b) => a + b, 0);
    const sorted = [...values].sort((a, b) => a - b);
    for (let i = 1; i < sorted.length; i++) expect(bright(sorted[i])).toBeGreaterThanOrEqual(bright(sorted[i - 1]));
  });
});

describe('escaping rule', () => {
  it('agrees with Python on every code point both Unicode versions assign alike', () => {
    const py = inRanges(C.escape.escaped);
    const pyUnassigned = inRanges(C.escape.unassigned);
    const one = new RegExp(`^${ESCAPED.source}$`, 'u');
    const cn = /^\p{Cn}$/u;
    const disagree: string[] = [];
    let skew = 0;
    for (let cp = 0; cp <= 0x10ffff; cp++) {
      const ch = String.fromCodePoint(cp);
      const ts = one.test(ch);
      const tsUnassigned = cn.test(ch);
      if (tsUnassigned !== (pyUnassigned[cp] === 1)) {
        // Assigned in one Unicode version only: the side that does not know it escapes it.
        skew++;
        if ((tsUnassigned && !ts) || (pyUnassigned[cp] === 1 && py[cp] !== 1)) disagree.push(cp.toString(16));
        continue;
      }
      if (ts !== (py[cp] === 1)) disagree.push(cp.toString(16));
    }
    expect(disagree.slice(0, 50), `Python Unicode ${C.escape.unicode}, ${skew} code points assigned on one side only`).toEqual([]);
  });

  it('draws the same labels', () => {
    for (const [label, shown] of C.escape.labels) expect(escapeLabel(label), JSON.stringify(label)).toBe(shown);
    for (const [label, n, shown] of C.escape.truncated) expect(truncateLabel(escapeLabel(label), n), `${JSON.stringify(label)} ${n}`).toBe(shown);
  });
});
