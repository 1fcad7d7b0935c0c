import { describe, expect, it } from 'vitest';
import {
  CircuitView,
  DEFAULT_TOP,
  MAX_TOP,
  circuitEdges,
  edgeGeometry,
  edgeInfo,
  faithfulnessScale,
  isCircuit,
  layoutGraph,
  sliderRange,
  strokeWidth,
  topEdges,
} from '../circuit';
import { normalizeState, type GridState } from '../data';
import { divergingColor } from '../format';
import { GridView } from '../grid';
import { viewFor } from '../views';
import { circuitState, f32spec } from './helpers';

function mount(state: GridState, callbacks = {}) {
  const el = document.createElement('div');
  document.body.appendChild(el);
  const view = new CircuitView(el, callbacks);
  view.update(state);
  return { el, view };
}

describe('circuit edges', () => {
  it('are every finite edge, largest |score| first, ties in row-major order', () => {
    const s = circuitState(2, 2, (i) => (i % 2 ? 0.3 : -0.3) * (i % 5 === 0 ? 2 : 1));
    const edges = circuitEdges(s);
    const finite = Array.from(s.arrays['edges/raw_mean'].data).filter(Number.isFinite).length;
    expect(edges.length).toBe(finite);
    for (let i = 1; i < edges.length; i++) {
      const [a, b] = [edges[i - 1], edges[i]];
      expect(Math.abs(a.score) >= Math.abs(b.score)).toBe(true);
      if (Math.abs(a.score) === Math.abs(b.score)) expect(a.row * 100 + a.col).toBeLessThan(b.row * 100 + b.col);
    }
    // The score is the raw metric less the corrupt baseline; the exact value rides along.
    const logitsFromEmb = edges.find((e) => e.row === s.row_labels.length - 1 && e.col === 0)!;
    expect(logitsFromEmb.exact).toBe(0.09);
    expect(edges.filter((e) => Number.isFinite(e.exact)).length).toBe(1);
  });

  it('keep the top n for the slider, between none and all', () => {
    const edges = circuitEdges(circuitState());
    expect(topEdges(edges, 5)).toEqual(edges.slice(0, 5));
    expect(topEdges(edges, -3)).toEqual([]);
    expect(topEdges(edges, 1e9).length).toBe(edges.length);
    expect(sliderRange(edges.length)).toEqual({ max: edges.length, value: Math.min(DEFAULT_TOP, edges.length) });
    expect(sliderRange(100000)).toEqual({ max: MAX_TOP, value: DEFAULT_TOP });
    expect(sliderRange(0)).toEqual({ max: 1, value: 1 });
  });
});

describe('circuit layout', () => {
  it('puts the embeddings at the bottom, each layer in a row above, the logits at the top', () => {
    const s = circuitState(3, 4);
    const layout = layoutGraph(s.circuit, 800);
    const names = s.circuit.nodes!.map((n) => n.name);
    const at = (name: string) => layout.nodes[names.indexOf(name)];
    expect(at('emb').y).toBeGreaterThan(at('0.0').y);
    expect(at('0.0').y).toBeGreaterThan(at('1.0').y);
    expect(at('2.3').y).toBeGreaterThan(at('logits').y);
    expect(at('0.0').y).toBe(at('0.3').y); // one row per layer
    expect(at('mlp0').y).toBeLessThan(at('0.0').y); // its MLP a little higher
    expect(at('mlp0').y).toBeGreaterThan(at('1.0').y);
    expect(at('0.0').x).toBeLessThan(at('0.1').x);
    for (const p of layout.nodes) {
      expect(p.x).toBeGreaterThanOrEqual(layout.left);
      expect(p.x).toBeLessThanOrEqual(layout.width);
      expect(p.y).toBeGreaterThan(0);
      expect(p.y).toBeLessThan(layout.height);
    }
  });

  it("runs an edge from its sender's top to its receiver's port, upwards", () => {
    const s = circuitState();
    const layout = layoutGraph(s.circuit, 800);
    const q = s.row_labels.indexOf('1.0.q');
    const v = s.row_labels.indexOf('1.0.v');
    const emb = (row: number) => edgeGeometry(s.circuit, layout, { row, col: 0, score: 1, recovery: NaN, exact: NaN });
    const [toQ, toV] = [emb(q), emb(v)];
    const node = layout.nodes[s.circuit.receivers![q]];
    expect(toQ.from).toEqual({ x: layout.nodes[0].x, y: layout.nodes[0].y - layout.radius });
    expect(toQ.to.y).toBe(node.y + layout.radius);
    expect(toQ.to.x).toBeLessThan(node.x); // q on the left, v on the right of the same node
    expect(toV.to.x).toBeGreaterThan(node.x);
    expect(toQ.c1.y).toBeLessThan(toQ.from.y);
    expect(toQ.c2.y).toBeGreaterThan(toQ.to.y);
    expect(strokeWidth(1, 1)).toBeGreaterThan(strokeWidth(0.1, 1));
    expect(strokeWidth(5, 1)).toBe(strokeWidth(1, 1));
  });

  it('scales the faithfulness curve: sizes on a log scale from 0, 0 and 1 inside the chart', () => {
    const sc = faithfulnessScale([0, 1, 10, 100], [0, 0.5, -0.4, 1.2], 0.8, 260, 170);
    expect(sc.x(0)).toBeLessThan(sc.x(1));
    // Near-logarithmic: a decade takes about the same width (a linear axis: ten times more).
    expect((sc.x(100) - sc.x(10)) / (sc.x(10) - sc.x(1))).toBeLessThan(1.5);
    expect(sc.lo).toBe(-0.4);
    expect(sc.hi).toBe(1.2);
    expect(sc.y(1)).toBeLessThan(sc.y(0));
    expect(sc.y(1.2)).toBeGreaterThanOrEqual(0);
    expect(sc.y(-0.4)).toBeLessThanOrEqual(170);
  });
});

describe('CircuitView (DOM)', () => {
  it('draws the top edges, coloured on the grids’ scale, and the slider changes how many', () => {
    const s = circuitState(3, 4);
    const { el, view } = mount(s);
    const all = circuitEdges(s);
    expect(all.length).toBeGreaterThan(DEFAULT_TOP);
    const drawn = () => el.querySelectorAll('g.pipatch-edge').length;
    expect(drawn()).toBe(DEFAULT_TOP);
    expect(view.root.getAttribute('data-edges')).toBe(String(DEFAULT_TOP));
    expect(view.root.getAttribute('data-edges-total')).toBe(String(all.length));
    const slider = el.querySelector<HTMLInputElement>('input.pipatch-top-n')!;
    expect(slider.max).toBe(String(all.length));
    expect(slider.hasAttribute('data-lm-suppress-shortcuts')).toBe(true); // JupyterLab leaves its keys alone
    slider.value = '7';
    slider.dispatchEvent(new Event('input'));
    expect(drawn()).toBe(7);
    expect(el.querySelector('.pipatch-top-n-label')!.textContent).toContain(`top 7 of ${all.length}`);
    // The largest edge is drawn last (on top), in its colour on the one diverging map.
    const items = Array.from(el.querySelectorAll('g.pipatch-edge'));
    const top = items[items.length - 1];
    expect([top.getAttribute('data-row'), top.getAttribute('data-col')]).toEqual([String(all[0].row), String(all[0].col)]);
    const vmax = Math.max(...all.map((e) => Math.abs(e.score)));
    const [r, g, b] = divergingColor(all[0].score, vmax);
    expect(top.querySelector('.pipatch-edge-line')!.getAttribute('stroke')).toBe(`rgb(${r},${g},${b})`);
    // A new state from the kernel keeps the user's choice.
    view.update(s);
    expect(drawn()).toBe(7);
    view.destroy();
  });

  it('names the nodes the drawn edges touch, and every string is text', () => {
    const s = circuitState();
    s.title = '<img src=x onerror=alert(1)>';
    s.warnings = ['<script>alert(1)</script>'];
    const { el, view } = mount(s);
    expect(el.querySelector('img, script, b')).toBeNull();
    expect(el.querySelector('.pipatch-title')!.textContent).toBe('<img src=x onerror=alert(1)>');
    const labels = Array.from(el.querySelectorAll('.pipatch-node-labels text')).map((t) => t.textContent);
    expect(labels).toContain('emb');
    expect(labels).toContain('logits');
    expect(el.querySelectorAll('.pipatch-node').length).toBe(s.circuit.nodes!.length);
    const rows = Array.from(el.querySelectorAll('.pipatch-rows text')).map((t) => t.textContent);
    expect(rows).toEqual(['embeddings', 'layer 0', 'layer 1', 'logits']);
    view.destroy();
  });

  it('describes an edge: its ends, the estimate and, where checked, the exact change', () => {
    const s = circuitState();
    const edges = circuitEdges(s);
    const checked = edges.findIndex((e) => Number.isFinite(e.exact));
    const lines = edgeInfo(s, edges[checked], checked, edges.length).join('\n');
    expect(lines).toContain('emb → logits');
    expect(lines).toContain('estimate: ');
    expect(lines).toContain('exact patch: 0.0900');
    expect(lines).toContain(`rank ${checked + 1} of ${edges.length}`);
    const other = edges.findIndex((e) => !Number.isFinite(e.exact));
    expect(edgeInfo(s, edges[other], other, edges.length).join('\n')).toContain('exact patch: not checked');
  });

  it('hovers an edge with its text, and a click selects its grid cell and shows the kernel’s answer', () => {
    const s = circuitState();
    const chosen: unknown[] = [];
    const { el, view } = mount(s, { live: true, onSelect: (sel: unknown) => chosen.push(sel), onUiChange: () => {} });
    const edges = circuitEdges(s);
    const target = el.querySelector(`g.pipatch-edge[data-row="${edges[0].row}"][data-col="${edges[0].col}"] .pipatch-edge-hit`)!;
    target.dispatchEvent(new MouseEvent('mousemove', { bubbles: true, clientX: 10, clientY: 10 }));
    const tip = el.querySelector<HTMLElement>('.pipatch-tooltip')!;
    expect(tip.style.display).toBe('block');
    expect(tip.textContent).toContain(`${s.col_labels[edges[0].col]} → ${s.row_labels[edges[0].row]}`);
    target.dispatchEvent(new MouseEvent('click', { bubbles: true }));
    expect(chosen).toEqual([{ view: 'edges', seed: -1, row: edges[0].row, col: edges[0].col }]);
    expect(el.querySelector('.pipatch-detail-hint')!.textContent).toContain('asking the kernel');
    expect(el.querySelector('.pipatch-edge-selected')).not.toBeNull();
    // The kernel's answer, as for a grid cell: the patched run's top-5.
    const answered = { ...s, detail: { view: 'edges', seed: -1, row: edges[0].row, col: edges[0].col, top: [{ token: '<b>x</b>', prob: 0.5 }], exact: 1.25, exact_pairs: 3 } };
    view.update(answered);
    expect(el.querySelector('.pipatch-top-token')!.textContent).toBe('<b>x</b>');
    expect(el.querySelector('.pipatch-detail-exact')!.textContent).toContain('1.25');
    expect(el.querySelector('.pipatch-detail-exact')!.textContent).toContain('mean over 3 pairs');
    expect(el.querySelector('.pipatch-detail-head')!.textContent).toContain('estimate: ');
    view.destroy();
  });

  it('draws the faithfulness curve when there is one, with its share and size, and nothing otherwise', () => {
    const f = { sizes: [0, 1, 5, 20, 60], recovery: [0, 0.3, 0.85, 0.9, 1], share: 0.8, size: 5, edges: 60 };
    const { el, view } = mount(circuitState(2, 2, undefined, { faithfulness: f }));
    expect(el.querySelector('.pipatch-faithfulness-chart')).not.toBeNull();
    expect(el.querySelector('.pipatch-curve')!.getAttribute('points')!.split(' ').length).toBe(5);
    expect(el.querySelector('.pipatch-share')).not.toBeNull();
    expect(el.querySelector('.pipatch-size')).not.toBeNull();
    expect(el.querySelector('.pipatch-faithfulness-size')!.textContent).toContain('with 5 of 60 edges');
    view.destroy();
    const none = mount(circuitState());
    expect(none.el.querySelector('.pipatch-faithfulness-chart')).toBeNull();
    none.view.destroy();
    const never = mount(circuitState(2, 2, undefined, { faithfulness: { ...f, size: null } }));
    expect(never.el.querySelector('.pipatch-size')).toBeNull();
    expect(never.el.querySelector('.pipatch-faithfulness-size')!.textContent).toContain('no circuit size reaches 80 % recovery');
    never.view.destroy();
  });

  it('shows the script that recomputes it as text, behind the Code button, when the state has one', () => {
    const { el, view } = mount({ ...circuitState(), code: 'print("<b>x</b>")\n' });
    const button = el.querySelector<HTMLButtonElement>('.pipatch-code-toggle')!;
    const panel = el.querySelector<HTMLElement>('.pipatch-code')!;
    expect(button.style.display).toBe('');
    expect(panel.style.display).toBe('none');
    button.click();
    expect(panel.style.display).toBe('');
    expect(el.querySelector('.pipatch-code-text')!.textContent).toBe('print("<b>x</b>")\n');
    expect(el.querySelector('b')).toBeNull();
    view.update(circuitState());
    expect(button.style.display).toBe('none');
    view.destroy();
  });

  it('exports the drawn graph as a standalone SVG', () => {
    const { view } = mount(circuitState());
    const text = view.svgText();
    expect(text.startsWith('<svg')).toBe(true);
    expect(text).toContain('http://www.w3.org/2000/svg');
    expect(text).not.toContain('pipatch-edge-hit');
    expect((text.match(/class="pipatch-edge"/g) ?? []).length).toBe(Math.min(DEFAULT_TOP, circuitEdges(circuitState()).length));
    view.destroy();
  });
});

describe('viewFor', () => {
  it('draws a circuit as a graph and anything else as a grid, switching when the kind changes', () => {
    const el = document.createElement('div');
    const s = circuitState();
    expect(isCircuit(s)).toBe(true);
    const first = viewFor(null, s, el, {});
    expect(first).toBeInstanceOf(CircuitView);
    expect(viewFor(first, s, el, {})).toBe(first);
    const grid = normalizeState({ views: ['resid'], row_labels: ['0'], col_labels: ['a'], arrays: { 'resid/mean': f32spec([0.5], [1, 1]) } });
    expect(isCircuit(grid)).toBe(false);
    const second = viewFor(first, grid, el, {});
    expect(second).toBeInstanceOf(GridView);
    expect(el.querySelectorAll('.pipatch-grid').length).toBe(1);
  });
});
