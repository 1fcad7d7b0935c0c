import { describe, expect, it } from 'vitest';
import { modeChoices, normalizeState, selectMatrix } from '../data';
import { buildCsv, divergingColor, scaleRange } from '../format';
import { GridView } from '../grid';
import { documentToState } from '../mime';
import { f32spec } from './helpers';

// a − b over a 2 × 3 grid (layers × tokens), as `pipatch.compare` sends it.
const A = [0.9, 0.1, 0.5, 0.2, 0.0, NaN];
const B = [0.5, 0.3, 0.5, 0.6, -0.1, 0.4];
const DIFF = A.map((a, i) => a - B[i]);

function comparison(rowsDone = 2) {
  return normalizeState({
    title: 'Comparison a − b of normalized recovery · causal trace',
    kind: 'compare',
    views: ['resid'],
    n_seeds: 1,
    metric: 'prob',
    row_labels: ['0', '1'],
    col_labels: ['The', ' Eiffel / Louvre', ' of'],
    rows_done: { resid: rowsDone },
    status: 'done',
    sides: ["a: gemma float32 · 'The Eiffel'", "b: gemma bfloat16 · 'The Louvre'"],
    compared: 'recovery',
    arrays: {
      'resid/mean': f32spec(DIFF, [2, 3]),
      'resid/a': f32spec(A, [2, 3]),
      'resid/b': f32spec(B, [2, 3]),
    },
  });
}

const WHITE = [0xf7, 0xf7, 0xf7];
const DARKEST_BLUE = [0x05, 0x30, 0x61];
const DARKEST_RED = [0x67, 0x00, 0x1f];

describe('comparison colour scale', () => {
  it('is diverging: 0 is the neutral centre, ±max|a − b| the two ends', () => {
    const s = comparison();
    const m = selectMatrix(s, 'resid', -1, 'diff');
    const vmax = scaleRange(s, 'resid', 'diff', m, [0, 2])[1];
    expect(vmax).toBeCloseTo(0.4, 6); // max |a − b| = |0.2 − 0.6| = |0.9 − 0.5|
    expect(divergingColor(0, vmax)).toEqual(WHITE);
    expect(divergingColor(-vmax, vmax)).toEqual(DARKEST_BLUE);
    expect(divergingColor(vmax, vmax)).toEqual(DARKEST_RED);
    // Symmetric: +v and −v sit at mirrored positions of the stops, equally far from white.
    const dist = (rgb: number[]) => Math.hypot(...rgb.map((c, i) => c - WHITE[i]));
    for (const v of [0.05, 0.1, 0.2, 0.3]) {
      const up = divergingColor(v, vmax);
      const down = divergingColor(-v, vmax);
      expect(up[0]).toBeGreaterThan(up[2]); // red side
      expect(down[2]).toBeGreaterThan(down[0]); // blue side
      expect(Math.abs(dist(up) - dist(down)) / dist(up)).toBeLessThan(0.35);
    }
    // Only finished rows set the scale.
    expect(scaleRange(s, 'resid', 'diff', m, [0, 1])[1]).toBeCloseTo(0.4, 6);
    expect(scaleRange(comparison(0), 'resid', 'diff', m, [0, 0])[1]).toBe(1);
  });

  it('draws a and b on one scale (max over both sides), so switching them keeps colours comparable', () => {
    const s = comparison();
    for (const side of ['a', 'b'] as const) {
      expect(scaleRange(s, 'resid', side, selectMatrix(s, 'resid', -1, side), [0, 2])[1]).toBeCloseTo(0.9, 6);
    }
  });
});

describe('comparison toggle', () => {
  it('offers a − b, a and b, each selecting its own array', () => {
    const s = comparison();
    expect(modeChoices(s).map(([m]) => m)).toEqual(['diff', 'a', 'b']);
    expect(Array.from(selectMatrix(s, 'resid', -1, 'diff').data!)).toEqual(Array.from(new Float32Array(DIFF)));
    expect(Array.from(selectMatrix(s, 'resid', -1, 'a').data!)).toEqual(Array.from(new Float32Array(A)));
    expect(Array.from(selectMatrix(s, 'resid', -1, 'b').data!)).toEqual(Array.from(new Float32Array(B)));
    // One result keeps its two modes.
    const one = normalizeState({ views: ['resid'], row_labels: ['0'], col_labels: ['x'], arrays: { 'resid/mean': f32spec([1], [1, 1]) } });
    expect(modeChoices(one).map(([m]) => m)).toEqual(['recovery', 'raw']);
  });

  it('the grid switches what it draws and the tooltip shows a, b and a − b', () => {
    const el = document.createElement('div');
    document.body.appendChild(el);
    const changes: unknown[] = [];
    const g = new GridView(el, { onUiChange: (p) => changes.push(p) });
    g.update(comparison(), { view: 'resid', seed: -1, mode: 'recovery' });
    expect(g.getUi().mode).toBe('diff'); // a comparison starts on a − b
    const select = el.querySelector<HTMLSelectElement>('select.pipatch-mode')!;
    expect(Array.from(select.options).map((o) => o.value)).toEqual(['diff', 'a', 'b']);
    const root = el.querySelector('.pipatch-grid')!;
    const checksums: string[] = [];
    for (const mode of ['diff', 'a', 'b']) {
      select.value = mode;
      select.dispatchEvent(new Event('change'));
      checksums.push(root.getAttribute('data-checksum')!);
      expect(el.querySelector('.pipatch-bar-name')!.textContent).toContain(mode === 'diff' ? 'a − b' : `${mode}:`);
    }
    expect(new Set(checksums).size).toBe(3);
    expect(changes).toContainEqual({ mode: 'b' });
    const info = g.cellInfo(1, 0).join('\n');
    expect(info).toContain('a − b: -0.400');
    expect(info).toContain('a: 0.200');
    expect(info).toContain('b: 0.600');
    expect(g.cellInfo(1, 2).join('\n')).toContain('a: NaN');
    // Both sides are named, as text.
    const sides = Array.from(el.querySelectorAll('.pipatch-side')).map((e) => e.textContent);
    expect(sides).toEqual(["a: gemma float32 · 'The Eiffel'", "b: gemma bfloat16 · 'The Louvre'"]);
    g.destroy();
  });

  it('a saved document keeps the chosen side, and its CSV holds a − b, a and b', () => {
    const s = comparison();
    const csv = buildCsv(s, 'resid', -1).trim().split('\n');
    expect(csv[0]).toBe('view,seed,row,row_label,col,col_label,a_minus_b,a,b');
    expect(csv).toHaveLength(1 + 6);
    expect(csv[4].split(',').slice(-3).map(Number)).toEqual([Math.fround(DIFF[3]), Math.fround(A[3]), Math.fround(B[3])]);
    const { ui } = documentToState({ ...comparison(), ui: { view: 'resid', seed: -1, mode: 'b' } });
    expect(ui?.mode).toBe('b');
  });
});

describe('a result that holds its metric (the logit lens)', () => {
  function lens() {
    return normalizeState({
      title: "Logit lens · gemma · ' Paris'",
      kind: 'lens',
      views: ['resid'],
      n_seeds: 1,
      metric: 'prob',
      row_labels: ['0', '1'],
      col_labels: ['The', ' of'],
      rows_done: { resid: 2 },
      status: 'done',
      values: 'metric',
      baselines: { output: 0.5 },
      arrays: { 'resid/mean': f32spec([0.0, 0.1, 0.2, 0.5], [2, 2]), 'resid/raw_mean': f32spec([0.0, 0.1, 0.2, 0.5], [2, 2]) },
    });
  }

  it('offers the metric alone, names it on the colour bar and in the tooltip, never as recovery', () => {
    const s = lens();
    expect(modeChoices(s)).toEqual([['recovery', 'prob']]);
    const el = document.createElement('div');
    document.body.appendChild(el);
    const g = new GridView(el, {});
    g.update(s, { view: 'resid', seed: -1, mode: 'raw' });
    expect(g.getUi().mode).toBe('recovery'); // the one mode there is
    expect(el.querySelector('.pipatch-bar-name')!.textContent).toBe('prob');
    const info = g.cellInfo(1, 1).join('\n');
    expect(info).toContain('prob: 0.500');
    expect(info).not.toContain('recovery');
    g.destroy();
  });
});
