import { describe, expect, it } from 'vitest';
import { normalizeState } from '../data';
import { checksum32, escapeLabel, shortLabel, tooltipLabel } from '../format';
import { GridView } from '../grid';
import { documentToState } from '../mime';
import { f32spec } from './helpers';

const HOSTILE = [
  '<img src=x onerror=window.__pwned=1>',
  '"><svg onload=window.__pwned=1>',
  '</script><script>window.__pwned=1</script>',
  'javascript:alert(1)',
  "'q' \"dq\" `bt` ${x}",
  'lone\uD800surrogate',
  'nul\u0000and\u0007ctl',
  '\u202Eevil',
  'zero\u200Dwidth',
  'x'.repeat(10000),
];

function hostileState() {
  const n = HOSTILE.length;
  return normalizeState({
    title: HOSTILE[2],
    kind: HOSTILE[0],
    model_name: HOSTILE[1],
    metric: HOSTILE[3],
    views: ['resid', HOSTILE[0]],
    n_seeds: 1,
    row_labels: HOSTILE.slice(0, 2),
    col_labels: HOSTILE,
    rows_done: { resid: 2 },
    total_rows: 2,
    status: 'failed',
    message: HOSTILE[1],
    warnings: HOSTILE,
    detail: { view: 'resid', seed: -1, row: 0, col: 0, top: [{ token: HOSTILE[0], prob: 0.5 }] },
    arrays: {
      'resid/mean': f32spec(Array.from({ length: 2 * n }, (_, i) => i / 10), [2, n]),
      'resid/raw_mean': f32spec(Array(2 * n).fill(0.3), [2, n]),
    },
  });
}

describe('hostile strings', () => {
  it('never create elements or handlers, in any text slot', () => {
    const el = document.createElement('div');
    document.body.appendChild(el);
    const g = new GridView(el, { live: true });
    g.update(hostileState(), { view: 'resid', seed: -1, mode: 'recovery', selected: { view: 'resid', seed: -1, row: 0, col: 0 } });
    expect(el.querySelector('img, svg, script, iframe, a[href]')).toBeNull();
    for (const e of Array.from(el.querySelectorAll('*'))) {
      for (const a of Array.from(e.attributes)) expect(a.name.startsWith('on')).toBe(false);
    }
    expect(el.querySelector('.pipatch-title')!.textContent).toBe(HOSTILE[2]);
    expect(el.querySelector('.pipatch-status')!.textContent).toContain(`failed: ${HOSTILE[1]}`);
    const warn = Array.from(el.querySelectorAll('.pipatch-warning')).map((w) => w.textContent);
    expect(warn[0]).toBe(`⚠ ${HOSTILE[0]}`);
    expect(el.querySelector('.pipatch-top-token')!.textContent).toBe(HOSTILE[0]);
    const opts = Array.from(el.querySelectorAll('.pipatch-view option')).map((o) => o.textContent);
    expect(opts).toContain(HOSTILE[0]);
    g.destroy();
  });
  it('make invisible characters visible and bound long labels', () => {
    expect(escapeLabel(HOSTILE[5])).toBe('lone⟨U+D800⟩surrogate');
    expect(escapeLabel(HOSTILE[6])).toBe('nul⟨U+0000⟩and⟨U+0007⟩ctl');
    expect(escapeLabel(HOSTILE[8])).toBe('zero⟨U+200D⟩width');
    expect(tooltipLabel(HOSTILE[9]).length).toBeLessThanOrEqual(400);
    expect(Array.from(shortLabel(HOSTILE[9], 14)).length).toBeLessThanOrEqual(14);
    expect(shortLabel(HOSTILE[9], 14).endsWith('…')).toBe(true);
    // Escaping a truncated prefix never leaves half a ⟨U+XXXX⟩ marker unbalanced at the start.
    expect(shortLabel('\u202E'.repeat(5000), 14).startsWith('⟨U+202E⟩')).toBe(true);
  });
  it('escapes a 10,000-character token in bounded time', () => {
    const t0 = performance.now();
    for (let i = 0; i < 1000; i++) shortLabel('\u200B'.repeat(10000), 14);
    expect(performance.now() - t0).toBeLessThan(2000);
  });
  it('reads a saved document with hostile strings as text', () => {
    const doc = JSON.parse(JSON.stringify({ version: 1, title: HOSTILE[2], col_labels: HOSTILE, views: ['resid'], status: 'running' }));
    const { state } = documentToState(doc);
    expect(state.title).toBe(HOSTILE[2]);
    expect(state.col_labels[5]).toBe('lone\uD800surrogate');
    expect(state.status).toBe('interrupted');
  });
});

describe('checksum32', () => {
  it('is stable and sensitive to every value', () => {
    const a = new Float32Array([0, 1.5, NaN, -2]);
    const b = new Float32Array([0, 1.5, NaN, -2.0000002]);
    expect(checksum32(a)).toBe(checksum32(new Float32Array(a)));
    expect(checksum32(a)).not.toBe(checksum32(b));
    expect(checksum32(null)).toBe('811c9dc5');
    expect(checksum32(a)).toMatch(/^[0-9a-f]{8}$/);
  });
  it('is exposed on the grid root', () => {
    const el = document.createElement('div');
    const g = new GridView(el, {});
    g.update(hostileState(), { view: 'resid' });
    expect(el.querySelector('.pipatch-grid')!.getAttribute('data-checksum')).toMatch(/^[0-9a-f]{8}$/);
  });
});
