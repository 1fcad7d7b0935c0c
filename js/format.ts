/** Pure helpers: label escaping, colour scale, layout maths, number formatting, CSV. */

import type { GridState, Mode } from './data';
import { gridShape, isComparison, matrixFor, selectMatrix, type Matrix } from './data';

/**
 * The escaping rule (the same as `pipatch/_results/views/strings.py`, checked on every code point by
 * `__tests__/parity.test.ts`): a code point is drawn as `⟨U+XXXX⟩` when its General_Category
 * is Cc (control), Cf (format: zero-width, bidi controls, BOM, soft hyphen, interlinear
 * annotation, tags), Cs (surrogate: only a lone one can be in a string), Co (private use),
 * Cn (unassigned, noncharacters included), Zl or Zp (line / paragraph separator), or it is
 * Default_Ignorable_Code_Point (variation selectors, Hangul fillers, ...).
 *
 * Unassigned code points are escaped on purpose: the browser's Unicode version and Python's
 * often differ, and a code point one side does not know yet is drawn as its number there.
 */
export const ESCAPED = /[\p{Cc}\p{Cf}\p{Cs}\p{Co}\p{Cn}\p{Zl}\p{Zp}\p{Default_Ignorable_Code_Point}]/u;
const ESCAPED_ALL = new RegExp(ESCAPED.source, 'gu');

function hex(cp: number): string {
  return cp.toString(16).toUpperCase().padStart(4, '0');
}

/**
 * Make every character of a label visible: the code points of the rule above become
 * `⟨U+XXXX⟩`; a label of only spaces shows `␣` (at most eight).
 */
export function escapeLabel(input: unknown): string {
  const s = typeof input === 'string' ? input : String(input ?? '');
  let out = s.replace(ESCAPED_ALL, (ch) => `⟨U+${hex(ch.codePointAt(0)!)}⟩`);
  if (out.length > 0 && /^ +$/.test(out)) out = '␣'.repeat(Math.min(out.length, 8));
  return out;
}

/** Truncate to at most `max` code points, ending in `…`; never splits a surrogate pair. */
export function truncateLabel(s: string, max: number): string {
  if (s.length <= max) return s;
  const cps = Array.from(s);
  if (cps.length <= max) return s;
  return cps.slice(0, Math.max(1, max - 1)).join('') + '…';
}

/** Visible short label for an axis tick. */
export function shortLabel(s: unknown, max = 24): string {
  const str = typeof s === 'string' ? s : String(s ?? '');
  // Escape only a bounded prefix: a 10,000-character token must stay cheap.
  const head = str.length > max * 4 + 8 ? str.slice(0, max * 4 + 8) : str;
  const esc = escapeLabel(head);
  if (head.length < str.length) return truncateLabel(esc, Math.min(max, Array.from(esc).length - 1) || 1).replace(/…?$/, '…');
  return truncateLabel(esc, max);
}

/** Full escaped label for tooltips, capped at a size a tooltip can show. */
export function tooltipLabel(s: unknown, max = 400): string {
  return truncateLabel(escapeLabel(s), max);
}

/**
 * Where a hover tooltip of `tipW` × `tipH` goes for a pointer at (`x`, `y`), all in the
 * coordinates of the widget's box (`boxW` × `boxH`): below right of the pointer, left of it where
 * it would pass the right edge, above it where it would pass the bottom, and in every case inside
 * the box as far as it fits (the output area around a widget clips what passes its edges: a grid
 * of three rows is shorter than its tooltip below the pointer). A tooltip taller than the box
 * starts at its top.
 */
export function tooltipPlace(x: number, y: number, tipW: number, tipH: number, boxW: number, boxH: number): { left: number; top: number } {
  const GAP = 14;
  const place = (at: number, size: number, room: number): number => {
    const after = at + GAP;
    const start = after + size > room ? at - size - GAP : after;
    return Math.max(0, Math.min(start, room - size));
  };
  return { left: place(x, tipW, boxW), top: place(y, tipH, boxH) };
}

export type RGB = [number, number, number];

/**
 * The one colour map (the same stops as `pipatch/_results/views/colors.py`): ColorBrewer's 11-class
 * RdBu reversed, i.e. matplotlib's RdBu_r — blue below 0, near white at 0, red above.
 */
export const DIVERGING_STOPS = [
  '#053061', '#2166ac', '#4393c3', '#92c5de', '#d1e5f0', '#f7f7f7',
  '#fddbc7', '#f4a582', '#d6604d', '#b2182b', '#67001f',
] as const;
export const NAN_RGB: RGB = [128, 128, 128];
/** Low to high, for values with no sign to show (as `SEQUENTIAL_STOPS` in Python): ColorBrewer's 9-class YlOrRd. */
export const SEQUENTIAL_STOPS = [
  '#ffffcc', '#ffeda0', '#fed976', '#feb24c', '#fd8d3c', '#fc4e2a', '#e31a1c', '#bd0026', '#800026',
] as const;
/** Metrics drawn on the sequential map when the cells hold the metric itself (as in Python). */
export const SEQUENTIAL_METRICS = ['prob', 'logprob'] as const;

/**
 * The colour scales (`pipatch/_results/views/colors.py`): 'diverging' for signed values (0 white),
 * 'sequential' for a probability or log-probability drawn as itself, 'rank' for the lens's
 * rank (rank 0 the darkest, paling on a log scale).
 */
export type ScaleKind = 'diverging' | 'sequential' | 'rank';

const rgbOf = (c: string): RGB => [parseInt(c.slice(1, 3), 16), parseInt(c.slice(3, 5), 16), parseInt(c.slice(5, 7), 16)];
const STOPS: RGB[] = DIVERGING_STOPS.map(rgbOf);
const SEQUENTIAL: RGB[] = SEQUENTIAL_STOPS.map(rgbOf);

/** Symmetric range: max |v| over finite values (1 if none). */
export function symmetricMax(data: ArrayLike<number> | null): number {
  let m = 0;
  if (data) {
    for (let i = 0; i < data.length; i++) {
      const v = data[i];
      if (Number.isFinite(v)) {
        const a = Math.abs(v);
        if (a > m) m = a;
      }
    }
  }
  return m > 0 ? m : 1;
}

/**
 * The scale of a state's cells drawn in `mode`: 'rank' for the metric rank drawn as itself,
 * 'sequential' for prob / logprob drawn as themselves (the logit lens; mode 'raw'),
 * 'diverging' for everything else. As `scale_kind` in `pipatch/_results/views/colors.py`.
 */
export function scaleKind(state: GridState, mode: Mode): ScaleKind {
  if (isComparison(state) || (state.circuit?.nodes?.length ?? 0) > 0) return 'diverging';
  if (state.values === 'metric' || mode === 'raw') {
    if (state.metric === 'rank') return 'rank';
    if ((SEQUENTIAL_METRICS as readonly string[]).includes(state.metric)) return 'sequential';
  }
  return 'diverging';
}

/**
 * The range `[lo, hi]` a scale of `kind` spans for `data` (its finite values): diverging
 * [−m, m] (m = `symmetricMax`); rank [0, worst rank]; sequential [min(0, min), max(0, max)];
 * an empty range one unit wide. As `value_range` in Python.
 */
export function valueRange(kind: ScaleKind, data: ArrayLike<number> | null): [number, number] {
  if (kind === 'diverging') {
    const m = symmetricMax(data);
    return [-m, m];
  }
  let min = Infinity;
  let max = -Infinity;
  if (data) {
    for (let i = 0; i < data.length; i++) {
      const v = data[i];
      if (Number.isFinite(v)) {
        if (v < min) min = v;
        if (v > max) max = v;
      }
    }
  }
  const any = max >= min;
  const lo = kind === 'rank' || !any ? 0 : Math.min(0, min);
  const hi = any ? Math.max(0, max) : 0;
  return hi > lo ? [lo, hi] : [lo, lo + 1];
}

/**
 * The colour scale's range `[lo, hi]` for matrix `m` of `view` drawn in `mode` (`valueRange`
 * of its `scaleKind`) over the finished rows (`span`, from `doneSpan`); for one side of a
 * comparison over both sides, so switching a ↔ b keeps the colours comparable. As
 * `scale_range` in `pipatch/_results/views/render.py`.
 */
export function scaleRange(state: GridState, view: string, mode: Mode, m: Matrix, span: Span): [number, number] {
  const [from, to] = [span[0] * m.cols, span[1] * m.cols];
  const kind = scaleKind(state, mode);
  if ((mode === 'a' || mode === 'b') && isComparison(state)) {
    const sides = (['a', 'b'] as Mode[]).map((side) => selectMatrix(state, view, -1, side).data).filter((d): d is Float32Array => d !== null);
    if (sides.length) {
      const n = to - from;
      const both = new Float32Array(n * sides.length);
      sides.forEach((d, i) => both.set(d.subarray(from, to), i * n));
      return valueRange(kind, both);
    }
  }
  return valueRange(kind, m.data ? m.data.subarray(from, to) : null);
}

/** Rows `[from, to)`: the finished rows of a view. */
export type Span = [number, number];

/**
 * The finished (drawn) rows of `view`; the rest are pending. As `done_span` in
 * `pipatch/_results/views/schema.py`: `rows_done[view]` rows from the top, or from the bottom when
 * `row_order[view]` is -1; a view missing from `rows_done` is finished unless the grid is running.
 */
export function doneSpan(state: GridState, view: string, rows: number): Span {
  const d = state.rows_done[view];
  const done = d === undefined ? (state.status === 'running' ? 0 : rows) : Math.max(0, Math.min(rows, Math.floor(d)));
  return state.row_order[view] === -1 ? [rows - done, rows] : [0, done];
}

/**
 * Diverging colour for v in [-vmax, vmax] (clipped): linear between the two nearest stops,
 * rounded; NaN gets NAN_RGB. Operation for operation as `diverging_rgb` in Python.
 */
export function divergingColor(v: number, vmax: number): RGB {
  if (!Number.isFinite(v)) {
    if (v === Infinity) return STOPS[STOPS.length - 1];
    if (v === -Infinity) return STOPS[0];
    return NAN_RGB;
  }
  let t = vmax > 0 ? v / vmax : 0;
  if (t > 1) t = 1;
  if (t < -1) t = -1;
  return between(STOPS, ((t + 1) / 2) * (STOPS.length - 1));
}

function between(stops: RGB[], pos: number): RGB {
  const i = Math.min(Math.floor(pos), stops.length - 2);
  const f = pos - i;
  const a = stops[i];
  const b = stops[i + 1];
  return [
    Math.floor(a[0] + (b[0] - a[0]) * f + 0.5),
    Math.floor(a[1] + (b[1] - a[1]) * f + 0.5),
    Math.floor(a[2] + (b[2] - a[2]) * f + 0.5),
  ];
}

/**
 * Where `v` falls on a sequential or rank scale over [lo, hi]: 0 the palest colour, 1 the
 * darkest (rank: `1 − log1p(v − lo) / log1p(hi − lo)`, so rank 0 is 1); clipped; NaN for NaN.
 * As `strength` in Python.
 */
export function strength(v: number, kind: ScaleKind, lo: number, hi: number): number {
  if (Number.isNaN(v)) return NaN;
  let t: number;
  if (kind === 'rank') {
    const span = hi > lo ? Math.log1p(hi - lo) : 0;
    t = span > 0 ? 1 - Math.log1p(Math.max(v - lo, 0)) / span : 1;
  } else {
    t = hi > lo ? (v - lo) / (hi - lo) : 0;
  }
  return Math.min(1, Math.max(0, t));
}

/**
 * The colour of `v` on the scale `kind` over [lo, hi] (`valueRange`); NaN grey. A diverging
 * scale is `divergingColor` with half-range max(|lo|, |hi|). Operation for operation as
 * `scale_rgb` in Python.
 */
export function scaleColor(v: number, kind: ScaleKind, lo: number, hi: number): RGB {
  if (kind === 'diverging') return divergingColor(v, Math.max(Math.abs(lo), Math.abs(hi)));
  const t = strength(v, kind, lo, hi);
  return Number.isNaN(t) ? NAN_RGB : between(SEQUENTIAL, t * (SEQUENTIAL.length - 1));
}

/** The colour at `u` (0 … 1) along a colour bar of `kind` drawn from lo (left) to hi (right). */
export function barColor(kind: ScaleKind, u: number): RGB {
  if (kind === 'diverging') return divergingColor(u * 2 - 1, 1);
  return between(SEQUENTIAL, (kind === 'rank' ? 1 - u : u) * (SEQUENTIAL.length - 1));
}

export interface Layout {
  cellW: number;
  cellH: number;
  width: number;
  height: number;
  colStride: number;
  rowStride: number;
  rotateCols: boolean;
  colLabelHeight: number;
}

/**
 * Cell sizes for a grid in the available width. Cells never go below 2 px wide (the
 * canvas then scrolls horizontally) so no column is dropped by resampling.
 */
export function computeLayout(rows: number, cols: number, availWidth: number, opts: { maxLabelChars?: number } = {}): Layout {
  const r = Math.max(rows, 1);
  const c = Math.max(cols, 1);
  const avail = Math.max(availWidth, 100);
  const cellW = Math.min(64, Math.max(2, avail / c));
  const cellH = Math.min(22, Math.max(3, Math.floor(560 / r)));
  const rotateCols = cellW < 56;
  const labelPx = rotateCols ? 13 : 60;
  const colStride = Math.max(1, Math.ceil(labelPx / cellW));
  const rowStride = Math.max(1, Math.ceil(12 / cellH));
  const chars = opts.maxLabelChars ?? 14;
  const colLabelHeight = rotateCols ? Math.min(130, 12 + chars * 6.5) : 20;
  return {
    cellW,
    cellH,
    width: Math.ceil(cellW * c),
    height: Math.ceil(cellH * r),
    colStride,
    rowStride,
    rotateCols,
    colLabelHeight,
  };
}

/** Cell under a pixel offset inside the heatmap canvas, or null. */
export function cellAt(x: number, y: number, layout: Layout, rows: number, cols: number): { row: number; col: number } | null {
  const col = Math.floor(x / layout.cellW);
  const row = Math.floor(y / layout.cellH);
  if (row < 0 || col < 0 || row >= rows || col >= cols) return null;
  return { row, col };
}

/**
 * 32-bit FNV-1a-style hash of the float32 bit patterns (8 hex digits): lets tests compare
 * what the browser draws with the kernel's array. Exposed as `data-checksum`.
 */
export function checksum32(data: Float32Array | null): string {
  let h = 0x811c9dc5;
  if (data) {
    const words = new Uint32Array(data.buffer, data.byteOffset, data.length);
    for (let i = 0; i < words.length; i++) h = Math.imul(h ^ words[i], 16777619) >>> 0;
  }
  return (h >>> 0).toString(16).padStart(8, '0');
}

export function formatValue(v: number | undefined | null, digits = 3): string {
  if (v == null) return '—';
  if (Number.isNaN(v)) return 'NaN';
  if (!Number.isFinite(v)) return v > 0 ? '+∞' : '−∞';
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return v.toFixed(digits);
}

export function formatDuration(seconds: number): string {
  if (!Number.isFinite(seconds) || seconds < 0) return '?';
  if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
  const m = Math.floor(seconds / 60);
  const s = Math.round(seconds % 60);
  if (m < 60) return `${m} min ${s} s`;
  return `${Math.floor(m / 60)} h ${m % 60} min`;
}

/** Rows finished across views and the total, for the status line. */
export function progress(state: GridState): { done: number; total: number } {
  let done = 0;
  for (const v of state.views.length ? state.views : Object.keys(state.rows_done)) done += state.rows_done[v] ?? 0;
  let total = state.total_rows;
  if (!(total > 0)) {
    total = 0;
    for (const v of state.views) total += gridShape(state, v).rows;
  }
  return { done: Math.min(done, total || done), total };
}

export function statusText(state: GridState): string {
  const { done, total } = progress(state);
  const parts: string[] = [];
  const st = state.status || 'done';
  if (st === 'running') parts.push(state.message ? `running: ${state.message}` : 'running');
  else if (st === 'failed') parts.push(state.message ? `failed: ${state.message}` : 'failed');
  else parts.push(state.message ? `${st}: ${state.message}` : st);
  parts.push(`${done} / ${total} rows`);
  if (state.elapsed > 0) parts.push(`${formatDuration(state.elapsed)} elapsed`);
  if (st === 'running') parts.push(state.eta >= 0 ? `~${formatDuration(state.eta)} left` : 'time left unknown');
  return parts.join(' · ');
}

/** Quote a CSV field; text that a spreadsheet would run as a formula gets a leading '. */
export function csvField(v: string | number): string {
  if (typeof v === 'number') return Number.isNaN(v) ? 'NaN' : String(v);
  let s = v;
  if (/^[=+\-@\t\r]/.test(s)) s = `'${s}`;
  if (/[",\r\n]/.test(s) || s !== s.trim()) s = `"${s.replace(/"/g, '""')}"`;
  return s;
}

/**
 * Long-format CSV for one view and seed selection: one line per cell, pending rows left out.
 * Columns: view, seed, row, row_label, col, col_label, then the values: recovery, std, raw,
 * verified (1/0); for a comparison a_minus_b, a, b.
 */
export function buildCsv(state: GridState, view: string, seed: number): string {
  const { rows, cols } = gridShape(state, view);
  const values = (mode: Mode) => selectMatrix(state, view, seed, mode).data;
  const ver = matrixFor(state, `${view}/verified`, rows, cols);
  const valueColumns: [string, Float32Array | null, (v: number) => string][] = isComparison(state)
    ? [['a_minus_b', values('diff'), csvField], ['a', values('a'), csvField], ['b', values('b'), csvField]]
    : [
        ['recovery', values('recovery'), csvField],
        ['std', seed < 0 ? matrixFor(state, `${view}/std`, rows, cols) : null, csvField],
        ['raw', values('raw'), csvField],
        ['verified', ver, (v) => String(v ? 1 : 0)],
      ];
  const [from, to] = doneSpan(state, view, rows);
  const lines = [['view', 'seed', 'row', 'row_label', 'col', 'col_label', ...valueColumns.map(([name]) => name)].join(',')];
  const seedName = seed < 0 ? 'mean' : String(seed);
  for (let r = from; r < to; r++) {
    const rl = csvField(state.row_labels[r] ?? String(r));
    for (let c = 0; c < cols; c++) {
      const i = r * cols + c;
      const cells = valueColumns.map(([, data, text]) => (data ? text(data[i]) : ''));
      lines.push([csvField(view), seedName, r, rl, c, csvField(state.col_labels[c] ?? String(c)), ...cells].join(','));
    }
  }
  return lines.join('\n') + '\n';
}

/** A file name from a title: letters, digits, dash and underscore only. */
export function safeFileName(title: string, ext: string): string {
  const base = (title || 'pipatch').replace(/[^A-Za-z0-9_-]+/g, '_').replace(/^_+|_+$/g, '').slice(0, 60);
  return `${base || 'pipatch'}.${ext}`;
}
