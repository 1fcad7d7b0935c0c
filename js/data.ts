/**
 * State decoding shared by the anywidget entry and the JupyterLab MIME renderer.
 *
 * Arrays arrive in one of two forms:
 *  - from the live widget: `{data: DataView | ArrayBuffer | Uint8Array, dtype, shape}`
 *    (ipywidgets turns the kernel's binary buffers into DataViews);
 *  - from a saved `application/vnd.pipatch.grid+json` document: `{data: <base64 str>, dtype, shape}`.
 * Both decode to a little-endian Float32Array plus its shape.
 */

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
  STATE_SCHEMA,
  TOP_SCHEMA,
} from './schema';

/**
 * What a view's cells show: for one result normalized recovery or the raw metric; for a
 * comparison (`sides` set) a − b ('diff') or one side ('a', 'b'). As `select_matrix` in
 * `pipatch/_results/views/schema.py`.
 */
export type Mode = 'recovery' | 'raw' | 'diff' | 'a' | 'b';
export type Status = 'running' | 'done' | 'stopped' | 'interrupted' | 'failed' | string;

export interface DecodedArray {
  data: Float32Array;
  shape: number[];
}

export interface TopToken {
  token: string;
  prob: number;
}

/** The TypeScript type of each schema type name. */
interface FieldTypes {
  str: string;
  'str[]': string[];
  int: number;
  'int[]': number[];
  'int?': number; // NaN where the kernel sent null
  float: number;
  'float[]': number[];
  'float?': number; // NaN where the kernel sent null
  'float?[]': number[];
  bool: boolean;
  '{str: int}': Record<string, number>;
  '{str: float?}': Record<string, number>;
  '{str: str[]}': Record<string, string[]>;
  arrays: Record<string, DecodedArray>;
  detail: Detail;
  'top[]': TopToken[];
  circuit: Circuit;
  'node[]': GraphNode[];
  'check[]': Check[];
  faithfulness: Faithfulness;
  feature_graph: FeatureGraph;
  'fnode[]': FeatureNode[];
  'fedge[]': FeatureEdge[];
  'group[]': Group[];
}
type FromSchema<S extends Record<string, keyof FieldTypes>> = { -readonly [K in keyof S]: FieldTypes[S[K]] };

/** A node of a circuit's graph (`NODE_SCHEMA`). */
export type GraphNode = FromSchema<typeof NODE_SCHEMA>;
/** An edge patched exactly (`CHECK_SCHEMA`): at grid cell (row, col). */
export type Check = FromSchema<typeof CHECK_SCHEMA>;
/** A circuit's faithfulness curve (`FAITHFULNESS_SCHEMA`). */
export type Faithfulness = FromSchema<typeof FAITHFULNESS_SCHEMA>;
/** A circuit's graph (`CIRCUIT_SCHEMA`); every field optional, `{}` for any other result. */
export type Circuit = Partial<FromSchema<typeof CIRCUIT_SCHEMA>>;

/** A node of a feature circuit (`FNODE_SCHEMA`). */
export type FeatureNode = FromSchema<typeof FNODE_SCHEMA>;
/** An edge of a feature circuit (`FEDGE_SCHEMA`). */
export type FeatureEdge = FromSchema<typeof FEDGE_SCHEMA>;
/** A supernode (`GROUP_SCHEMA`). */
export type Group = FromSchema<typeof GROUP_SCHEMA>;
/** A feature circuit's graph (`FEATURE_GRAPH_SCHEMA`); every field optional, `{}` for any other result. */
export type FeatureGraph = Partial<FromSchema<typeof FEATURE_GRAPH_SCHEMA>>;

/** The kernel's answer to a click (`DETAIL_SCHEMA`); every field optional. */
export type Detail = Partial<FromSchema<typeof DETAIL_SCHEMA>>;

export interface Selection {
  view: string;
  seed: number;
  row: number;
  col: number;
}

/** Everything the kernel (or a saved document) tells the grid: `STATE_SCHEMA` as types. */
export type GridState = FromSchema<typeof STATE_SCHEMA>;

/** What the user chose in the UI (synced back to the kernel by the widget). */
export interface UiState {
  view: string;
  seed: number;
  mode: Mode;
  selected: Selection | Record<string, never>;
}

function bytesFromBase64(b64: string): Uint8Array {
  const clean = b64.replace(/[^A-Za-z0-9+/=_-]/g, '').replace(/-/g, '+').replace(/_/g, '/');
  if (typeof atob === 'function') {
    const bin = atob(clean);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  // Node without atob (very old); vitest on Node 20 has atob, kept for safety.
  const B = (globalThis as unknown as { Buffer?: { from(s: string, e: string): Uint8Array } }).Buffer;
  if (B) return new Uint8Array(B.from(clean, 'base64'));
  throw new Error('no base64 decoder available');
}

/** Raw bytes of any supported buffer form, as a Uint8Array view (no copy where possible). */
export function toBytes(data: unknown): Uint8Array {
  if (data == null) return new Uint8Array(0);
  if (typeof data === 'string') return bytesFromBase64(data);
  if (data instanceof Uint8Array) return data;
  if (data instanceof ArrayBuffer) return new Uint8Array(data);
  if (ArrayBuffer.isView(data)) {
    const v = data as ArrayBufferView;
    return new Uint8Array(v.buffer, v.byteOffset, v.byteLength);
  }
  if (typeof data === 'object' && data !== null && 'buffer' in data) {
    return toBytes((data as { buffer: unknown }).buffer);
  }
  throw new Error('unsupported array data');
}

const ITEM: Record<string, number> = { float32: 4, float64: 8, float16: 2, uint8: 1, bool: 1, int32: 4 };

function halfToFloat(h: number): number {
  const s = h & 0x8000 ? -1 : 1;
  const e = (h >> 10) & 0x1f;
  const f = h & 0x3ff;
  if (e === 0) return s * 2 ** -14 * (f / 1024);
  if (e === 31) return f ? NaN : s * Infinity;
  return s * 2 ** (e - 15) * (1 + f / 1024);
}

/** Decode `{data, dtype, shape}` to a Float32Array (little-endian source) with its shape. */
export function decodeArray(spec: unknown): DecodedArray {
  if (spec == null || typeof spec !== 'object') throw new Error('array spec must be an object');
  const s = spec as { data?: unknown; dtype?: string; shape?: unknown };
  if (Array.isArray(s.data)) {
    // Plain JSON numbers (never produced by pipatch, tolerated for hand-written documents).
    const arr = Float32Array.from(s.data as number[], (x) => (x == null ? NaN : Number(x)));
    const shape = Array.isArray(s.shape) ? (s.shape as number[]).map(Number) : [arr.length];
    return { data: arr, shape };
  }
  const dtype = (s.dtype || 'float32').toLowerCase();
  const item = ITEM[dtype];
  if (!item) throw new Error(`unsupported dtype ${dtype}`);
  const bytes = toBytes(s.data);
  const n = Math.floor(bytes.byteLength / item);
  let shape = Array.isArray(s.shape) ? (s.shape as unknown[]).map((x) => Number(x)) : [n];
  const expected = shape.reduce((a, b) => a * b, 1);
  if (!Number.isFinite(expected) || expected !== n) {
    throw new Error(`array of ${n} ${dtype} items does not match shape [${shape.join(', ')}]`);
  }
  let out: Float32Array;
  if (dtype === 'float32' && bytes.byteOffset % 4 === 0 && isLittleEndian()) {
    out = new Float32Array(bytes.buffer, bytes.byteOffset, n);
  } else {
    out = new Float32Array(n);
    const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    for (let i = 0; i < n; i++) {
      switch (dtype) {
        case 'float32': out[i] = dv.getFloat32(i * 4, true); break;
        case 'float64': out[i] = dv.getFloat64(i * 8, true); break;
        case 'float16': out[i] = halfToFloat(dv.getUint16(i * 2, true)); break;
        case 'int32': out[i] = dv.getInt32(i * 4, true); break;
        default: out[i] = dv.getUint8(i);
      }
    }
  }
  if (shape.length === 0) shape = [];
  return { data: out, shape };
}

let _le: boolean | null = null;
function isLittleEndian(): boolean {
  if (_le === null) _le = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
  return _le;
}

function asStringList(x: unknown): string[] {
  if (!Array.isArray(x)) return [];
  return x.map((v) => (typeof v === 'string' ? v : String(v)));
}

function asNumber(x: unknown, d: number): number {
  if (x === null || x === undefined) return d;
  const n = typeof x === 'number' ? x : Number(x);
  return Number.isFinite(n) ? n : d;
}

/** Values a missing or unreadable field takes (otherwise '' / 0 / false / [] / {}). */
const DEFAULTS: Partial<Record<keyof GridState, unknown>> = {
  col_axis: 'token',
  n_seeds: 1,
  seed_noun: 'seeds',
  status: 'done',
  eta: -1,
};

function asRecord(x: unknown): Record<string, unknown> {
  return x && typeof x === 'object' && !Array.isArray(x) ? (x as Record<string, unknown>) : {};
}

/** One value read as schema type `type` (`fallback` when it is missing or unreadable). */
function readField(type: keyof FieldTypes, x: unknown, fallback: unknown, errors: string[]): unknown {
  switch (type) {
    case 'str':
      return typeof x === 'string' ? x : x === undefined || x === null ? (fallback ?? '') : String(x);
    case 'str[]':
      return asStringList(x);
    case 'int':
      return Math.floor(asNumber(x, (fallback as number) ?? 0));
    case 'int?':
      return Math.floor(asNumber(x, NaN));
    case 'int[]':
      return Array.isArray(x) ? x.map((v) => Math.floor(asNumber(v, 0))) : [];
    case 'float':
      return asNumber(x, (fallback as number) ?? 0);
    case 'float[]':
      return Array.isArray(x) ? x.map((v) => asNumber(v, 0)) : [];
    case 'float?':
      return asNumber(x, NaN);
    case 'float?[]':
      return Array.isArray(x) ? x.map((v) => asNumber(v, NaN)) : [];
    case 'bool':
      return x === true;
    case '{str: int}':
    case '{str: float?}': {
      const out: Record<string, number> = {};
      for (const [k, v] of Object.entries(asRecord(x))) out[k] = type === '{str: int}' ? asNumber(v, 0) : asNumber(v, NaN);
      return out;
    }
    case '{str: str[]}': {
      const out: Record<string, string[]> = {};
      for (const [k, v] of Object.entries(asRecord(x))) out[k] = asStringList(v);
      return out;
    }
    case 'arrays': {
      const out: Record<string, DecodedArray> = {};
      for (const [name, spec] of Object.entries(asRecord(x))) {
        try {
          out[name] = decodeArray(spec);
        } catch (e) {
          errors.push(`array ${name}: ${(e as Error).message}`);
        }
      }
      return out;
    }
    case 'detail':
      return readObject(DETAIL_SCHEMA, x, errors);
    case 'top[]':
      return Array.isArray(x) ? x.map((t) => readObject(TOP_SCHEMA, t, errors)) : [];
    case 'circuit':
      return readObject(CIRCUIT_SCHEMA, x, errors);
    case 'node[]':
      return Array.isArray(x) ? x.map((n) => readObject(NODE_SCHEMA, n, errors, true)) : [];
    case 'check[]':
      return Array.isArray(x) ? x.map((c) => readObject(CHECK_SCHEMA, c, errors, true)) : [];
    case 'faithfulness':
      return readObject(FAITHFULNESS_SCHEMA, x, errors, true);
    case 'feature_graph':
      return readObject(FEATURE_GRAPH_SCHEMA, x, errors);
    case 'fnode[]':
      return Array.isArray(x) ? x.map((n) => readObject(FNODE_SCHEMA, n, errors, true)) : [];
    case 'fedge[]':
      return Array.isArray(x) ? x.map((e) => readObject(FEDGE_SCHEMA, e, errors, true)) : [];
    case 'group[]':
      return Array.isArray(x) ? x.map((g) => readObject(GROUP_SCHEMA, g, errors, true)) : [];
  }
}

/** The fields of `x` that `schema` names, each read as its type; absent fields stay absent
 * (`whole`: they take their type's empty value, for an object whose every field is drawn). */
function readObject(schema: Record<string, keyof FieldTypes>, x: unknown, errors: string[], whole = false): Record<string, unknown> {
  const raw = asRecord(x);
  const out: Record<string, unknown> = {};
  for (const [key, type] of Object.entries(schema)) if (whole || key in raw) out[key] = readField(type, raw[key], undefined, errors);
  return out;
}

/** Problems with the arrays' dtypes and shapes against `ARRAY_SCHEMA` (dimensions from the labels). */
export function arrayProblems(state: GridState, raw: Record<string, unknown> = {}): string[] {
  const problems: string[] = [];
  const dims: Record<string, number> = {
    rows: state.row_labels.length,
    cols: state.col_labels.length,
    seeds: state.n_seeds,
  };
  const specs = asRecord(raw.arrays);
  for (const [name, a] of Object.entries(state.arrays)) {
    const what = name.slice(name.lastIndexOf('/') + 1) as keyof typeof ARRAY_SCHEMA;
    const dtype = asRecord(specs[name]).dtype;
    if (dtype !== undefined && dtype !== ARRAY_DTYPE) problems.push(`array ${name}: dtype ${String(dtype)}, expected ${ARRAY_DTYPE}`);
    const want = ARRAY_SCHEMA[what];
    if (!want) continue;
    const expected = want.map((d) => dims[d]);
    if (expected.some((n) => !(n > 0))) continue; // labels missing: the array is the only source
    if (a.shape.length !== expected.length || a.shape.some((n, i) => n !== expected[i])) {
      problems.push(`array ${name}: shape [${a.shape.join(', ')}], labels say [${expected.join(', ')}]`);
    }
  }
  return problems;
}

/** The name of entry `seed` of the seed axis (-1: the mean over it), as every view shows it. */
export function seedLabel(state: GridState, seed: number): string {
  if (seed < 0) return state.n_seeds > 1 ? `mean of ${state.n_seeds} ${state.seed_noun}` : 'mean';
  return state.seed_labels[seed] || `seed ${seed}`;
}

/** Read a raw state (traits or a saved document) through `STATE_SCHEMA`. Never throws on bad arrays. */
export function normalizeState(raw: Record<string, unknown>, errors: string[] = []): GridState {
  const out: Record<string, unknown> = {};
  for (const [key, type] of Object.entries(STATE_SCHEMA)) {
    out[key] = readField(type, raw[key], DEFAULTS[key as keyof GridState], errors);
  }
  const state = out as GridState;
  state.n_seeds = Math.max(0, state.n_seeds);
  if (state.views.length === 0) {
    const found = new Set<string>();
    for (const k of Object.keys(state.arrays)) if (k.includes('/')) found.add(k.slice(0, k.lastIndexOf('/')));
    state.views = [...found];
  }
  errors.push(...arrayProblems(state, raw));
  return state;
}

/** Grid dimensions: rows from labels or the first array found for the view. */
export function gridShape(state: GridState, view: string): { rows: number; cols: number } {
  const a = state.arrays[`${view}/mean`] ?? state.arrays[`${view}/raw_mean`];
  if (a && a.shape.length >= 2) {
    return { rows: a.shape[a.shape.length - 2], cols: a.shape[a.shape.length - 1] };
  }
  return { rows: state.row_labels.length, cols: state.col_labels.length };
}

export interface Matrix {
  data: Float32Array | null;
  rows: number;
  cols: number;
}

/** Whether the state is a comparison of two results (its cells are a − b). */
export function isComparison(state: GridState): boolean {
  return state.sides.length === 2;
}

/** Whether one result's cells hold the metric itself (the logit lens), not normalized recovery. */
export function holdsMetric(state: GridState): boolean {
  return !isComparison(state) && state.values === 'metric';
}

/** The modes the grid offers, with their names: a − b / a / b for a comparison; the metric
 * alone for a result that holds it. */
export function modeChoices(state: GridState): [Mode, string][] {
  if (holdsMetric(state)) return [['recovery', state.metric || 'metric']];
  if (!isComparison(state)) return [['recovery', 'normalized recovery'], ['raw', 'raw metric']];
  return [['diff', 'a − b'], ['a', 'a'], ['b', 'b']];
}

/** What the cells of a comparison hold, in words. */
export function comparedValues(state: GridState): string {
  return state.compared === 'raw' ? `raw ${state.metric || 'metric'}` : 'normalized recovery';
}

/** The [rows, cols] slice shown for this view / seed (-1 = mean) / mode; seed slices are views. */
export function selectMatrix(state: GridState, view: string, seed: number, mode: Mode): Matrix {
  const { rows, cols } = gridShape(state, view);
  const names = mode === 'a' || mode === 'b' ? [`${view}/${mode}`] : mode === 'raw' ? [`${view}/raw_seeds`, `${view}/raw_mean`] : [`${view}/seeds`, `${view}/mean`];
  if (seed >= 0 && names.length === 2) {
    const a = state.arrays[names[0]];
    if (a && a.shape.length === 3 && seed < a.shape[0]) {
      const n = a.shape[1] * a.shape[2];
      return { data: a.data.subarray(seed * n, (seed + 1) * n), rows: a.shape[1], cols: a.shape[2] };
    }
  }
  const m = state.arrays[names[names.length - 1]];
  if (m && m.data.length === rows * cols) return { data: m.data, rows, cols };
  return { data: null, rows, cols };
}

export function matrixFor(state: GridState, name: string, rows: number, cols: number): Float32Array | null {
  const a = state.arrays[name];
  return a && a.data.length === rows * cols ? a.data : null;
}
