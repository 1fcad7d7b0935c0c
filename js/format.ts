/** Pure helpers: label escaping, colour scale, layout maths, number formatting, CSV. */

import type { GridState, Mode } from './data';
import { gridShape, matrixFor, selectMatrix } from './data';

// Code points that are invisible, reorder text or break lines: shown as ⟨U+XXXX⟩.
function isInvisible(cp: number): boolean {
  return (
    cp <= 0x1f ||
    (cp >= 0x7f && cp <= 0x9f) ||
    cp === 0xad ||
    cp === 0x34f ||
    cp === 0x61c ||
    cp === 0x115f ||
    cp === 0x1160 ||
    cp === 0x17b4 ||
    cp === 0x17b5 ||
    (cp >= 0x180b && cp <= 0x180f) ||
    (cp >= 0x200b && cp <= 0x200f) ||
    (cp >= 0x2028 && cp <= 0x202e) ||
    (cp >= 0x2060 && cp <= 0x206f) ||
    cp === 0x3164 ||
    (cp >= 0xfe00 && cp <= 0xfe0f) ||
    cp === 0xfeff ||
    cp === 0xffa0 ||
    (cp >= 0xfff0 && cp <= 0xfffb) ||
    (cp >= 0xd800 && cp <= 0xdfff) || // lone surrogates (paired ones never reach here)
    (cp >= 0xe0000 && cp <= 0xe0fff)
  );
}

function hex(cp: number): string {
  return cp.toString(16).toUpperCase().padStart(4, '0');
}

/**
 * Make every character of a label visible: control characters, zero-width characters,
 * bidi overrides and lone surrogates become `⟨U+XXXX⟩`; a label of only spaces shows `␣`.
 */
export function escapeLabel(input: unknown): string {
  const s = typeof input === 'string' ? input : String(input ?? '');
  let out = '';
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    let cp = c;
    if (c >= 0xd800 && c <= 0xdbff && i + 1 < s.length) {
      const d = s.charCodeAt(i + 1);
      if (d >= 0xdc00 && d <= 0xdfff) {
        cp = (c - 0xd800) * 0x400 + (d - 0xdc00) + 0x10000;
        if (isInvisible(cp)) out += `⟨U+${hex(cp)}⟩`;
        else out += s[i] + s[i + 1];
        i++;
        continue;
      }
    }
    out += isInvisible(cp) ? `⟨U+${hex(cp)}⟩` : s[i];
  }
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

export type RGB = [number, number, number];

export const NAN_RGB: RGB = [128, 128, 128];
const NEG: RGB = [33, 102, 172]; // blue
const MID: RGB = [247, 247, 247]; // near white
const POS: RGB = [178, 24, 43]; // red

/** Symmetric range: max |v| over finite values (1 if none). */
export function symmetricMax(data: ArrayLike<number> | null, limit = data ? data.length : 0): number {
  let m = 0;
  if (data) {
    for (let i = 0; i < limit; i++) {
      const v = data[i];
      if (Number.isFinite(v)) {
        const a = Math.abs(v);
        if (a > m) m = a;
      }
    }
  }
  return m > 0 ? m : 1;
}

/** Diverging blue-white-red colour for v in [-vmax, vmax]; NaN gets NAN_RGB. */
export function divergingColor(v: number, vmax: number): RGB {
  if (!Number.isFinite(v)) {
    if (v === Infinity) return POS;
    if (v === -Infinity) return NEG;
    return NAN_RGB;
  }
  let t = vmax > 0 ? v / vmax : 0;
  if (t > 1) t = 1;
  if (t < -1) t = -1;
  const end = t >= 0 ? POS : NEG;
  const a = Math.abs(t);
  return [
    Math.round(MID[0] + (end[0] - MID[0]) * a),
    Math.round(MID[1] + (end[1] - MID[1]) * a),
    Math.round(MID[2] + (end[2] - MID[2]) * a),
  ];
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
  if (st === 'running') parts.push('running');
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
 * Columns: view, seed, row, row_label, col, col_label, recovery, std, raw, verified.
 */
export function buildCsv(state: GridState, view: string, seed: number): string {
  const { rows, cols } = gridShape(state, view);
  const rec = selectMatrix(state, view, seed, 'recovery' as Mode).data;
  const raw = selectMatrix(state, view, seed, 'raw' as Mode).data;
  const std = seed < 0 ? matrixFor(state, `${view}/std`, rows, cols) : null;
  const ver = matrixFor(state, `${view}/verified`, rows, cols);
  const done = Math.min(rows, state.rows_done[view] ?? rows);
  const lines = ['view,seed,row,row_label,col,col_label,recovery,std,raw,verified'];
  const seedName = seed < 0 ? 'mean' : String(seed);
  for (let r = 0; r < done; r++) {
    const rl = csvField(state.row_labels[r] ?? String(r));
    for (let c = 0; c < cols; c++) {
      const i = r * cols + c;
      lines.push(
        [
          csvField(view),
          seedName,
          r,
          rl,
          c,
          csvField(state.col_labels[c] ?? String(c)),
          rec ? csvField(rec[i]) : '',
          std ? csvField(std[i]) : '',
          raw ? csvField(raw[i]) : '',
          ver ? String(ver[i] ? 1 : 0) : '',
        ].join(','),
      );
    }
  }
  return lines.join('\n') + '\n';
}

/** A file name from a title: letters, digits, dash and underscore only. */
export function safeFileName(title: string, ext: string): string {
  const base = (title || 'pipatch').replace(/[^A-Za-z0-9_-]+/g, '_').replace(/^_+|_+$/g, '').slice(0, 60);
  return `${base || 'pipatch'}.${ext}`;
}
