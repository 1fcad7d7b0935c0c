import { describe, expect, it } from 'vitest';
import {
  NAN_RGB,
  buildCsv,
  cellAt,
  computeLayout,
  csvField,
  divergingColor,
  doneSpan,
  escapeLabel,
  formatValue,
  safeFileName,
  scaleRange,
  shortLabel,
  statusText,
  symmetricMax,
  tooltipLabel,
  tooltipPlace,
  truncateLabel,
} from '../format';
import { normalizeState } from '../data';
import { f32spec } from './helpers';

describe('escapeLabel', () => {
  it('keeps ordinary text, including markup, as-is', () => {
    expect(escapeLabel(' Paris')).toBe(' Paris');
    expect(escapeLabel('<img src=x onerror=alert(1)>')).toBe('<img src=x onerror=alert(1)>');
  });
  it('makes control, zero-width and bidi characters visible', () => {
    expect(escapeLabel('a\u0000b')).toBe('a⟨U+0000⟩b');
    expect(escapeLabel('\n')).toBe('⟨U+000A⟩');
    expect(escapeLabel('x\u200dy')).toBe('x⟨U+200D⟩y');
    expect(escapeLabel('\u202Eevil')).toBe('⟨U+202E⟩evil');
    expect(escapeLabel('\uFEFF')).toBe('⟨U+FEFF⟩');
  });
  it('survives lone surrogates and keeps pairs', () => {
    expect(escapeLabel('a\uD800b')).toBe('a⟨U+D800⟩b');
    expect(escapeLabel('\uDC00')).toBe('⟨U+DC00⟩');
    expect(escapeLabel('😀')).toBe('😀');
  });
  it('shows all-space labels', () => {
    expect(escapeLabel('  ')).toBe('␣␣');
  });
  it('accepts non-strings', () => {
    expect(escapeLabel(12 as unknown as string)).toBe('12');
    expect(escapeLabel(null)).toBe('');
  });
});

describe('truncation', () => {
  it('truncates by code point with an ellipsis', () => {
    expect(truncateLabel('abcdef', 4)).toBe('abc…');
    expect(truncateLabel('😀😀😀😀😀', 3)).toBe('😀😀…');
    expect(truncateLabel('abc', 4)).toBe('abc');
  });
  it('handles a 10,000-character token cheaply', () => {
    const long = 'x'.repeat(10000);
    const s = shortLabel(long, 14);
    expect(Array.from(s).length).toBeLessThanOrEqual(14);
    expect(s.endsWith('…')).toBe(true);
    expect(tooltipLabel(long).length).toBeLessThanOrEqual(400);
  });
  it('never splits a surrogate pair nor an escape', () => {
    const s = shortLabel('\u202E'.repeat(50), 14);
    expect(s.endsWith('…')).toBe(true);
    expect(() => encodeURIComponent(shortLabel('😀'.repeat(40), 5))).not.toThrow();
  });
});

describe('colour scale', () => {
  it('is white at 0, red at +max, blue at -max, symmetric', () => {
    expect(divergingColor(0, 1)).toEqual([247, 247, 247]);
    const r = divergingColor(1, 1);
    const b = divergingColor(-1, 1);
    expect(r[0]).toBeGreaterThan(r[2]);
    expect(b[2]).toBeGreaterThan(b[0]);
    const half = divergingColor(0.5, 1);
    expect(half[0]).toBeGreaterThan(half[2]);
    expect(divergingColor(5, 1)).toEqual(divergingColor(1, 1));
  });
  it('gives NaN a colour that is not on the scale', () => {
    expect(divergingColor(NaN, 1)).toEqual(NAN_RGB);
    for (let v = -1; v <= 1; v += 0.05) expect(divergingColor(v, 1)).not.toEqual(NAN_RGB);
  });
  it('uses max |v| over finite values', () => {
    expect(symmetricMax(new Float32Array([0.2, -0.7, NaN, 0.1]))).toBeCloseTo(0.7);
    expect(symmetricMax(new Float32Array([NaN]))).toBe(1);
    expect(symmetricMax(new Float32Array([0.2, -0.7, 3]).subarray(0, 2))).toBeCloseTo(0.7);
    expect(symmetricMax(null)).toBe(1);
  });
});

describe('finished rows', () => {
  const grid = (extra: object) =>
    normalizeState({ views: ['resid'], row_labels: ['0', '1', '2'], col_labels: ['a', 'b'], status: 'running',
      arrays: { 'resid/mean': f32spec([5, -1, 0.5, 0.2, -0.3, 0.1], [3, 2]) }, ...extra });

  it('are a band from the top, or from the bottom when the rows run from the last layer up', () => {
    expect(doneSpan(grid({ rows_done: { resid: 1 } }), 'resid', 3)).toEqual([0, 1]);
    expect(doneSpan(grid({ rows_done: { resid: 1 }, row_order: { resid: -1 } }), 'resid', 3)).toEqual([2, 3]);
    expect(doneSpan(grid({ rows_done: { resid: 9 }, row_order: { resid: -1 } }), 'resid', 3)).toEqual([0, 3]);
    expect(doneSpan(grid({ row_order: { resid: -1 } }), 'resid', 3)).toEqual([3, 3]); // running, nothing yet
    expect(doneSpan(grid({ status: 'done' }), 'resid', 3)).toEqual([0, 3]);
  });

  it('alone set the colour scale', () => {
    const up = grid({ rows_done: { resid: 2 }, row_order: { resid: -1 } });
    const m = { rows: 3, cols: 2, data: new Float32Array([5, -1, 0.5, 0.2, -0.3, 0.1]) };
    expect(scaleRange(up, 'resid', 'recovery', m, doneSpan(up, 'resid', 3))[1]).toBeCloseTo(0.5);
    expect(scaleRange(up, 'resid', 'recovery', m, [0, 1])[1]).toBeCloseTo(5);
  });
});

describe('layout', () => {
  it('fits small grids and scrolls large ones (cells ≥ 2 px)', () => {
    const small = computeLayout(12, 10, 800);
    expect(small.width).toBeLessThanOrEqual(800);
    expect(small.colStride).toBe(1);
    const big = computeLayout(64, 2000, 800);
    expect(big.cellW).toBe(2);
    expect(big.width).toBe(4000);
    expect(big.colStride).toBeGreaterThan(1);
    expect(big.rotateCols).toBe(true);
    const huge = computeLayout(100, 4000, 800);
    expect(huge.width).toBe(8000);
    expect(huge.height).toBeLessThanOrEqual(100 * 22);
    expect(huge.rowStride).toBeGreaterThanOrEqual(1);
  });
  it('maps pixels to cells', () => {
    const l = computeLayout(4, 5, 500);
    expect(cellAt(0, 0, l, 4, 5)).toEqual({ row: 0, col: 0 });
    expect(cellAt(l.cellW * 4.5, l.cellH * 3.5, l, 4, 5)).toEqual({ row: 3, col: 4 });
    expect(cellAt(l.cellW * 5.1, 1, l, 4, 5)).toBeNull();
    expect(cellAt(-1, 1, l, 4, 5)).toBeNull();
  });
});

describe('formatting', () => {
  it('formats values', () => {
    expect(formatValue(NaN)).toBe('NaN');
    expect(formatValue(0.12345)).toBe('0.123');
    expect(formatValue(Infinity)).toBe('+∞');
    expect(formatValue(undefined)).toBe('—');
  });
  it('builds status lines', () => {
    const s = normalizeState({ views: ['resid'], rows_done: { resid: 3 }, total_rows: 12, status: 'running', elapsed: 2.5, eta: 7.5 });
    expect(statusText(s)).toBe('running · 3 / 12 rows · 2.5 s elapsed · ~7.5 s left');
    // A running grid's message (a study's facts done / known / total) is part of its status line.
    expect(statusText({ ...s, message: '3 done · 5 known · 12 total' })).toBe(
      'running: 3 done · 5 known · 12 total · 3 / 12 rows · 2.5 s elapsed · ~7.5 s left');
    const f = normalizeState({ views: ['resid'], rows_done: { resid: 3 }, total_rows: 12, status: 'failed', message: 'CUDA OOM' });
    expect(statusText(f)).toContain('failed: CUDA OOM');
    const u = normalizeState({ views: ['resid'], rows_done: { resid: 0 }, total_rows: 12, status: 'running', eta: -1 });
    expect(statusText(u)).toContain('time left unknown');
  });
  it('makes safe file names', () => {
    expect(safeFileName('../../etc/<x>', 'csv')).toBe('etc_x.csv');
    expect(safeFileName('', 'png')).toBe('pipatch.png');
  });
});

describe('CSV', () => {
  it('quotes text and guards formulas', () => {
    expect(csvField('a,b')).toBe('"a,b"');
    expect(csvField('say "hi"')).toBe('"say ""hi"""');
    expect(csvField('=1+1')).toBe("'=1+1");
    expect(csvField(' Paris')).toBe('" Paris"');
    expect(csvField(NaN)).toBe('NaN');
  });
  it('builds one line per finished cell', () => {
    const s = normalizeState({
      views: ['resid'],
      n_seeds: 2,
      row_labels: ['0', '1', '2'],
      col_labels: ['The', ' Eiffel', ','],
      rows_done: { resid: 2 },
      arrays: {
        'resid/mean': f32spec([1, 2, 3, 4, 5, 6, 0, 0, 0], [3, 3]),
        'resid/std': f32spec([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0, 0, 0], [3, 3]),
        'resid/raw_mean': f32spec([9, 8, 7, 6, 5, NaN, 0, 0, 0], [3, 3]),
        'resid/seeds': f32spec([...Array(9).fill(1), ...Array(9).fill(2)], [2, 3, 3]),
        'resid/raw_seeds': f32spec([...Array(9).fill(3), ...Array(9).fill(4)], [2, 3, 3]),
      },
    });
    const csv = buildCsv(s, 'resid', -1).trim().split('\n');
    expect(csv[0]).toBe('view,seed,row,row_label,col,col_label,recovery,std,raw,verified');
    expect(csv.length).toBe(1 + 2 * 3);
    expect(csv[2]).toBe('resid,mean,0,0,1," Eiffel",2,0.10000000149011612,8,');
    expect(csv[3]).toContain('","');
    expect(csv[6]).toContain('NaN');
    const seed1 = buildCsv(s, 'resid', 1).trim().split('\n');
    expect(seed1[1]).toBe('resid,1,0,0,0,The,2,,4,');
    // Rows that run from the last layer up: the finished rows are the last two.
    const up = buildCsv({ ...s, row_order: { resid: -1 } }, 'resid', -1).trim().split('\n');
    expect(up.length).toBe(1 + 2 * 3);
    expect(up[1]).toBe('resid,mean,1,1,0,The,4,0.10000000149011612,6,');
    expect(up[6].startsWith('resid,mean,2,2,2,",",0,')).toBe(true);
  });
});

describe('tooltipPlace', () => {
  it('puts the tooltip below right of the pointer where it fits', () => {
    expect(tooltipPlace(50, 40, 200, 100, 800, 600)).toEqual({ left: 64, top: 54 });
  });
  it('flips it left of and above the pointer near the right and bottom edges', () => {
    expect(tooltipPlace(700, 500, 200, 100, 800, 600)).toEqual({ left: 486, top: 386 });
  });
  it('keeps it inside a short box: a grid of three rows whose tooltip is taller than the room below or above', () => {
    // A 3-row grid: the box is 160 px high, the pointer on the last row, the tooltip 130 px.
    const place = tooltipPlace(120, 140, 260, 130, 600, 160);
    expect(place.top).toBeGreaterThanOrEqual(0);
    expect(place.top + 130).toBeLessThanOrEqual(160);
    expect(tooltipPlace(120, 20, 260, 130, 600, 160).top + 130).toBeLessThanOrEqual(160);
  });
  it('starts a tooltip taller than the box at the top, never above it', () => {
    expect(tooltipPlace(10, 50, 100, 400, 600, 160)).toEqual({ left: 24, top: 0 });
  });
});
