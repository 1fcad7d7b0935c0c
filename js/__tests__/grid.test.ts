import { describe, expect, it } from 'vitest';
import { normalizeState } from '../data';
import { showTooltip } from '../dom';
import { GridView } from '../grid';
import { documentToState } from '../mime';
import { f32bytes, f32spec, toBase64 } from './helpers';

function sample(status = 'running') {
  return normalizeState({
    title: '<b>title</b>',
    views: ['resid', 'mlp'],
    n_seeds: 2,
    metric: 'p(answer)',
    row_labels: ['0', '1', '2'],
    col_labels: ['<img src=x onerror=alert(1)>', '\u202Eevil', 'x'.repeat(10000)],
    rows_done: { resid: 2, mlp: 0 },
    total_rows: 6,
    status,
    stoppable: true,
    warnings: ['<script>alert(1)</script>'],
    arrays: {
      'resid/mean': f32spec([0.1, 0.5, NaN, 1, 0, -0.2, 0, 0, 0], [3, 3]),
      'resid/std': f32spec(Array(9).fill(0.05), [3, 3]),
      'resid/raw_mean': f32spec(Array(9).fill(0.3), [3, 3]),
    },
  });
}

describe('GridView (DOM)', () => {
  it('renders text only: no element is created from label or message text', () => {
    const el = document.createElement('div');
    document.body.appendChild(el);
    const g = new GridView(el, {});
    g.update(sample());
    expect(el.querySelector('img')).toBeNull();
    expect(el.querySelector('script')).toBeNull();
    expect(el.querySelector('b')).toBeNull();
    const labels = Array.from(el.querySelectorAll('.pipatch-collabel')).map((e) => e.textContent);
    expect(labels[0]!.startsWith('<img src')).toBe(true);
    const titles = Array.from(el.querySelectorAll('.pipatch-collabel')).map((e) => e.getAttribute('title'));
    expect(titles[0]).toBe('<img src=x onerror=alert(1)>');
    expect(titles[2]!.length).toBeLessThanOrEqual(400);
    expect(labels.some((l) => l!.startsWith('⟨U+202E⟩'))).toBe(true);
    expect(el.querySelector('.pipatch-title')!.textContent).toBe('<b>title</b>');
    expect(el.querySelector('.pipatch-warnings')!.textContent).toContain('<script>');
    g.destroy();
  });
  it('shows the stop button only while running and stoppable', () => {
    const el = document.createElement('div');
    let stopped = 0;
    const g = new GridView(el, { onStop: () => stopped++ });
    g.update(sample('running'));
    const btn = el.querySelector<HTMLButtonElement>('.pipatch-stop')!;
    expect(btn.style.display).toBe('');
    btn.click();
    expect(stopped).toBe(1);
    g.update(sample('done'));
    expect(btn.style.display).toBe('none');
  });
  it('describes cells with value, spread, raw and pending rows', () => {
    const el = document.createElement('div');
    const g = new GridView(el, {});
    g.update(sample(), { view: 'resid', seed: -1, mode: 'recovery' });
    const info = g.cellInfo(0, 1).join('\n');
    expect(info).toContain('recovery: 0.500 ± 0.050');
    expect(info).toContain('raw p(answer): 0.300');
    expect(g.cellInfo(0, 2).join('\n')).toContain('NaN');
    expect(g.cellInfo(2, 0).join('\n')).toContain('pending');
    expect(el.querySelector('.pipatch-grid')!.getAttribute('data-rows-done')).toBe('2');
  });
  it('draws rows that run from the last layer up as a finished band at the bottom', () => {
    const el = document.createElement('div');
    const g = new GridView(el, {});
    const s = sample();
    s.row_order = { resid: -1 };
    g.update(s, { view: 'resid', seed: -1, mode: 'recovery' });
    expect(g.cellInfo(0, 1).join('\n')).toContain('pending');
    expect(g.cellInfo(1, 1).join('\n')).toContain('recovery: 0.000 ± 0.050');
    expect(g.cellInfo(2, 0).join('\n')).not.toContain('pending');
    expect(el.querySelector('.pipatch-grid')!.getAttribute('data-rows-done')).toBe('2');
  });
  it('names the seed axis as the state does, and shows no spread for one seed', () => {
    const el = document.createElement('div');
    const g = new GridView(el, {});
    const raw = { ...sample('done'), seed_noun: 'prompts', seed_labels: ['prompt 0: The Eiffel', 'prompt 1: The Louvre'] };
    g.update(normalizeState(raw as never), { view: 'resid', seed: -1, mode: 'recovery' });
    const options = Array.from(el.querySelectorAll('select.pipatch-seed option')).map((o) => o.textContent);
    expect(options).toEqual(['mean of 2 prompts', 'prompt 0: The Eiffel', 'prompt 1: The Louvre']);
    expect(g.cellInfo(0, 1)).toContain('mean of 2 prompts');
    g.update(normalizeState(raw as never), { view: 'resid', seed: 1, mode: 'recovery' });
    expect(g.cellInfo(0, 1)).toContain('prompt 1: The Louvre');
    // One seed: the std array (all zeros) is no spread to show.
    const one = normalizeState({ ...sample('done'), n_seeds: 1 } as never);
    g.update(one, { view: 'resid', seed: -1, mode: 'recovery' });
    expect(g.cellInfo(0, 1).join('\n')).not.toContain('±');
    expect(g.cellInfo(0, 1).join('\n')).not.toContain('seed');
  });
  it('switches view through the select and reports it', () => {
    const el = document.createElement('div');
    const changes: unknown[] = [];
    const g = new GridView(el, { onUiChange: (p) => changes.push(p) });
    g.update(sample());
    const sel = el.querySelector<HTMLSelectElement>('.pipatch-view')!;
    sel.value = 'mlp';
    sel.dispatchEvent(new Event('change'));
    expect(changes[0]).toEqual({ view: 'mlp', selected: {} });
    expect(g.getUi().view).toBe('mlp');
  });
});

describe('MIME document', () => {
  it('decodes base64 arrays and marks a saved running grid as interrupted', () => {
    const { state, errors } = documentToState({
      version: 1,
      views: ['resid'],
      status: 'running',
      stoppable: true,
      arrays: { 'resid/mean': { dtype: 'float32', shape: [1, 2], data: toBase64(f32bytes([1, 2])) } },
    });
    expect(errors).toEqual([]);
    expect(Array.from(state.arrays['resid/mean'].data)).toEqual([1, 2]);
    expect(state.status).toBe('interrupted');
    expect(state.stoppable).toBe(false);
  });
  it('warns on a newer version and accepts a JSON string', () => {
    const { errors } = documentToState(JSON.stringify({ version: 2 }));
    expect(errors[0]).toMatch(/version 2/);
  });
});

describe('GridView: attribution results', () => {
  it('marks cells verified by a real patch in the tooltip', () => {
    const el = document.createElement('div');
    const g = new GridView(el, {});
    const s = sample('done');
    const verified = normalizeState({
      ...s,
      rows_done: { resid: 3, mlp: 3 },
      arrays: {
        'resid/mean': f32spec([0.1, 0.5, 0.2, 1, 0, -0.2, 0, 0, 0], [3, 3]),
        'resid/raw_mean': f32spec(Array(9).fill(0.3), [3, 3]),
        'resid/verified': f32spec([0, 1, 0, 0, 0, 0, 0, 0, 0], [3, 3]),
      },
    });
    g.update(verified, { view: 'resid', seed: -1, mode: 'recovery' });
    expect(g.cellInfo(0, 1)).toContain('verified by a real patch');
    expect(g.cellInfo(0, 0)).not.toContain('verified by a real patch');
    // The overlay outlines exactly the verified cells (as the figure's □).
    expect(g.root.getAttribute('data-verified')).toBe('1');
    g.destroy();
  });
});

describe('GridView: scales and marks', () => {
  function lens(metric: string, values: number[]) {
    return normalizeState({
      title: 'lens',
      kind: 'lens',
      views: ['resid'],
      n_seeds: 1,
      metric,
      values: 'metric',
      row_labels: ['0', '1'],
      col_labels: ['The', '<b>Eiffel</b>', ' Tower'],
      rows_done: { resid: 2 },
      status: 'done',
      subject: [1, 2],
      arrays: { 'resid/mean': f32spec(values, [2, 3]), 'resid/raw_mean': f32spec(values, [2, 3]) },
    });
  }

  it("draws the lens's rank on the rank scale from rank 0 (the darkest end) to the worst rank", () => {
    const el = document.createElement('div');
    const g = new GridView(el, {});
    g.update(lens('rank', [5000, 40, 3, 12, 0, 1]));
    expect(g.root.getAttribute('data-scale')).toBe('rank');
    expect(el.querySelector('.pipatch-bar-min')!.textContent).toBe('0');
    expect(el.querySelector('.pipatch-bar-max')!.textContent).toBe('5000');
    g.update(lens('prob', [0.01, 0.2, 0.5, 0.1, 0.9, 0.6]));
    expect(g.root.getAttribute('data-scale')).toBe('sequential');
    g.update(sample('done'));
    expect(g.root.getAttribute('data-scale')).toBe('diverging');
    g.destroy();
  });

  it("marks the subject's columns: their labels (as text) and the overlay", () => {
    const el = document.createElement('div');
    const g = new GridView(el, {});
    g.update(lens('prob', [0.01, 0.2, 0.5, 0.1, 0.9, 0.6]));
    const labels = Array.from(el.querySelectorAll('.pipatch-collabel'));
    expect(labels.map((e) => e.classList.contains('pipatch-subject'))).toEqual([false, true, true]);
    expect(labels[1].textContent!.startsWith('<b>Eiffe')).toBe(true);
    expect(labels[1].getAttribute('title')).toBe('<b>Eiffel</b> (subject)');
    expect(el.querySelector('b')).toBeNull();
    expect(g.root.getAttribute('data-subject')).toBe('1,2');
    expect(g.cellInfo(0, 1).join(' ')).toContain('(subject)');
    expect(g.cellInfo(0, 0).join(' ')).not.toContain('(subject)');
    g.update(sample('done'));
    expect(el.querySelectorAll('.pipatch-subject').length).toBe(0);
    g.destroy();
  });
});

describe('the hover tooltip', () => {
  it('stays inside the box of a short grid (three rows) where it would pass the bottom edge', () => {
    const box = document.createElement('div');
    const tip = document.createElement('div');
    box.append(tip);
    // A widget 160 px high (a grid of three rows) and a tooltip of 260 × 130 px.
    box.getBoundingClientRect = () => ({ left: 10, top: 500, width: 600, height: 160, right: 610, bottom: 660, x: 10, y: 500, toJSON: () => ({}) });
    Object.defineProperty(tip, 'offsetWidth', { value: 260 });
    Object.defineProperty(tip, 'offsetHeight', { value: 130 });
    for (const clientY of [510, 580, 650]) {
      showTooltip(tip, box, new MouseEvent('mousemove', { clientX: 300, clientY }));
      const top = parseFloat(tip.style.top);
      expect(tip.style.display).toBe('block');
      expect(top).toBeGreaterThanOrEqual(0);
      expect(top + 130).toBeLessThanOrEqual(160);
    }
  });
});
