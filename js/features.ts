/**
 * A feature circuit's view: its graph of SAE latents and error nodes, shared by the anywidget
 * view (widget.ts) and the JupyterLab MIME renderer (mime.ts), which pick it by `viewFor`
 * (views.ts) when the state's `feature_graph` part (`FEATURE_GRAPH_SCHEMA`, made by
 * `FeatureCircuitResult.to_state` in `pipatch/_results/feature_circuit.py`) has nodes.
 *
 * Rows are the SAEs (the first at the bottom, the metric's node on top), columns the
 * positions; nodes sharing a place sit side by side in it. A node's area follows its |score|
 * (the estimated change of the metric), its colour the score's sign and size on the diverging
 * map; error nodes are squares, latents circles, the metric a diamond; a node checked by an
 * exact patch has a dark ring. Edges are lines coloured by their score. The threshold and
 * top-n controls filter the nodes (and the edges between the ones left) here, without the
 * kernel. Hover shows a node's name, latent, label and top contexts, estimate and exact value;
 * an edge's two ends, its estimate and, where it was patched exactly, its exact value.
 *
 * A click on a node asks the kernel for its exact ablation (the live widget; the answer
 * arrives as the node's `exact`); shift-click adds nodes to the selection, which the Group
 * button names as a supernode (sent to the kernel, or, in a saved copy, kept in the document).
 * The SVG, PNG and JSON buttons save the graph as drawn and the graph's data. Every string is
 * set as text (`textContent`, attributes); no HTML is parsed.
 */

import type { FeatureEdge, FeatureGraph, FeatureNode, GridState, Group } from './data';
import { divergingColor, formatValue, tooltipLabel } from './format';
import { h, rgb, standaloneSvg, svg, SVG_NS } from './dom';
import { View, type GridCallbacks } from './view';

/** Nodes drawn at first (the largest |score|): the controls change it. */
export const DEFAULT_NODES = 40;

/** Whether a state is a feature circuit's (drawn as its graph). */
export function isFeatureGraph(s: GridState): boolean {
  return (s.feature_graph?.nodes?.length ?? 0) > 0;
}

/** What the controls keep: nodes with |score| ≥ `threshold`, at most `top` of them (largest
 * first; the metric's node always), and the edges whose ends are both kept. */
export interface Filter {
  threshold: number;
  top: number;
}

/** The kept nodes' indices (largest |score| first, the metric first) and edges. */
export function filterGraph(g: FeatureGraph, f: Filter): { nodes: number[]; edges: FeatureEdge[] } {
  const nodes = g.nodes ?? [];
  const order = nodes.map((_, i) => i).filter((i) => nodes[i].kind !== 'metric');
  const size = (i: number) => (Number.isFinite(nodes[i].score) ? Math.abs(nodes[i].score) : 0);
  order.sort((a, b) => size(b) - size(a) || a - b);
  const kept = order.filter((i) => size(i) >= f.threshold).slice(0, Math.max(0, Math.floor(f.top)));
  const metric = nodes.map((n, i) => (n.kind === 'metric' ? i : -1)).filter((i) => i >= 0);
  const all = [...metric, ...kept];
  const set = new Set(all);
  return { nodes: all, edges: (g.edges ?? []).filter((e) => set.has(e.up) && set.has(e.down)) };
}

export interface Point {
  x: number;
  y: number;
}

export interface FeatureLayout {
  width: number;
  height: number;
  left: number;
  colWidth: number;
  rowGap: number;
  /** Per node index (of `g.nodes`): where it is drawn and its radius; absent when not kept. */
  at: Map<number, Point & { r: number }>;
}

const LEFT = 110; // the row names
const TOP = 16;
const BOTTOM = 40; // the column names

/** The largest |score| of the nodes kept (1 when none), the scale of their sizes. */
function largest(nodes: FeatureNode[], kept: number[]): number {
  const m = Math.max(0, ...kept.filter((i) => nodes[i].kind !== 'metric').map((i) => Math.abs(nodes[i].score)).filter(Number.isFinite));
  return m > 0 ? m : 1;
}

/** The distance between the centres of two nodes sharing a place (the largest radius × 2, plus a gap). */
const SLOT = 2 * 12 + 3;

/**
 * Pixel places of the `kept` nodes in `width` pixels: row = the node's SAE (the first at the
 * bottom, the metric on top), column = its position; nodes of one place side by side in it,
 * in the order kept (largest first), on as many lines as they need (rows grow to hold the
 * fullest place). A node's radius is 3–12 px, its area in proportion to |score| (the metric:
 * the largest).
 */
export function layoutFeatures(g: FeatureGraph, kept: number[], width: number): FeatureLayout {
  const nodes = g.nodes ?? [];
  const positions = g.positions?.length ? g.positions : [...new Set(nodes.map((n) => n.position))].sort((a, b) => a - b);
  const rows = (g.sites?.length ?? 0) + 1;
  const w = Math.max(width, 320);
  const colWidth = (w - LEFT - 12) / Math.max(1, positions.length);
  const fit = Math.max(1, Math.floor((colWidth - 4) / SLOT));
  const column = (n: FeatureNode) => {
    const col = positions.indexOf(n.position);
    return col < 0 ? positions.length - 1 : col;
  };
  const slot = new Map<number, number>();
  const perPlace = new Map<string, number>();
  for (const i of kept) {
    const key = `${nodes[i].row}:${column(nodes[i])}`;
    slot.set(i, perPlace.get(key) ?? 0);
    perPlace.set(key, (slot.get(i) ?? 0) + 1);
  }
  const lines = Math.max(1, ...[...perPlace.values()].map((n) => Math.ceil(n / fit)));
  const rowGap = Math.max(64, lines * SLOT + 16);
  const height = TOP + rows * rowGap + BOTTOM;
  const vmax = largest(nodes, kept);
  const at = new Map<number, Point & { r: number }>();
  for (const i of kept) {
    const n = nodes[i];
    const k = slot.get(i) ?? 0;
    const x = LEFT + column(n) * colWidth + SLOT / 2 + (k % fit) * SLOT;
    const y = TOP + (rows - 1 - n.row) * rowGap + 8 + SLOT / 2 + Math.floor(k / fit) * SLOT;
    const share = n.kind === 'metric' ? 1 : Math.min(1, Math.abs(Number.isFinite(n.score) ? n.score : 0) / vmax);
    at.set(i, { x, y, r: 3 + 9 * Math.sqrt(share) });
  }
  return { width: w, height, left: LEFT, colWidth, rowGap, at };
}

/** A node's lines of text (tooltip, detail): name, which latent, its label and top contexts,
 * the estimate and the exact value. */
export function nodeInfo(n: FeatureNode, metric: string): string[] {
  const what = n.kind === 'latent' ? `latent ${n.latent} at position ${n.position}`
    : n.kind === 'error' ? `error node (what the SAE misses) at position ${n.position}`
      : n.kind === 'embed' ? `token embedding at position ${n.position}` : `the metric (${metric || 'metric'})`;
  const lines = [tooltipLabel(n.name), what];
  if (n.note) lines.push(...n.note.split('\n').map((l) => tooltipLabel(l, 120)));
  lines.push(`estimate: ${formatValue(n.score, 4)} (change of ${metric || 'metric'})`);
  lines.push(Number.isFinite(n.exact) ? `exact: ${formatValue(n.exact, 4)}` : 'exact: not checked');
  return lines;
}

/** An edge's lines of text (tooltip): its ends (by name), the estimate and the exact value. */
export function edgeInfo(e: FeatureEdge, nodes: FeatureNode[], metric: string): string[] {
  const name = (i: number) => nodes[i]?.name ?? `node ${i}`;
  return [
    tooltipLabel(`${name(e.up)} → ${name(e.down)}`, 120),
    `estimate: ${formatValue(e.score, 4)} (change of ${metric || 'metric'})`,
    Number.isFinite(e.exact) ? `exact: ${formatValue(e.exact, 4)}` : 'exact: not checked',
  ];
}

/** The groups with `name` set to `members` (an empty list removes it), as the kernel does. */
export function withGroup(groups: Group[], name: string, members: string[]): Group[] {
  const rest = groups.filter((g) => g.name !== name);
  return members.length ? [...rest, { name, nodes: [...members] }] : rest;
}


/** A feature circuit's nodes and edges as a graph, filtered here; a click on a node asks the
 * kernel for its exact ablation, shift-clicked nodes are grouped as supernodes. */
export class FeatureView extends View {
  private filter: Filter = { threshold: 0, top: DEFAULT_NODES };
  private selected = new Set<string>();
  private clicked = '';
  private waiting = '';
  private hover = ''; // what the tooltip shows: `n:<node index>`, `e:<edge index>` or nothing
  private layout: FeatureLayout | null = null;
  private groups: Group[] = [];

  private threshold = h('input', 'pipatch-threshold');
  private top = h('input', 'pipatch-top-n');
  private topLabel = h('span', 'pipatch-top-n-label');
  private groupName = h('input', 'pipatch-group-name');
  private groupBtn = h('button', 'pipatch-group', 'Group');
  private svgBtn = h('button', 'pipatch-svg', 'SVG');
  private pngBtn = h('button', 'pipatch-png', 'PNG');
  private jsonBtn = h('button', 'pipatch-json', 'JSON');
  private graph = svg('svg', { class: 'pipatch-graph pipatch-feature-graph' });
  private groupsEl = h('div', 'pipatch-groups');

  constructor(el: HTMLElement, callbacks: GridCallbacks = {}) {
    super(el, callbacks, 'pipatch-features');
    this.threshold.type = 'number';
    this.threshold.min = '0';
    this.threshold.step = 'any';
    this.threshold.value = '0';
    this.threshold.title = 'the least |estimate| a node drawn has';
    this.top.type = 'range';
    this.top.min = '1';
    this.top.title = 'how many nodes to draw: the largest |estimate| first';
    this.groupName.type = 'text';
    this.groupName.placeholder = 'supernode name';
    this.groupBtn.title = 'name the selected nodes (shift-click to select) as a supernode';
    this.svgBtn.title = 'download the graph as SVG';
    this.pngBtn.title = 'download the graph as PNG';
    this.jsonBtn.title = "download the graph's nodes, edges and supernodes as JSON";
    for (const b of [this.groupBtn, this.svgBtn, this.pngBtn, this.jsonBtn]) b.type = 'button';
    for (const input of [this.threshold, this.top, this.groupName]) input.setAttribute('data-lm-suppress-shortcuts', 'true');
    const thresholdBox = h('label', 'pipatch-threshold-box');
    thresholdBox.append(h('span', undefined, '|estimate| ≥ '), this.threshold);
    const topBox = h('label', 'pipatch-top-n-box');
    topBox.append(h('span', undefined, 'nodes '), this.top, this.topLabel);
    this.toolbar.append(thresholdBox, topBox, this.groupName, this.groupBtn, this.svgBtn, this.pngBtn, this.jsonBtn);
    this.mount(el, [this.graph, this.groupsEl]);

    this.listen(this.threshold, 'input', () => {
      const v = Number(this.threshold.value);
      this.filter = { ...this.filter, threshold: Number.isFinite(v) && v > 0 ? v : 0 };
      this.render();
    });
    this.listen(this.top, 'input', () => {
      this.filter = { ...this.filter, top: Number(this.top.value) };
      this.render();
    });
    this.listen(this.groupBtn, 'click', () => this.makeGroup());
    this.listen(this.svgBtn, 'click', () => this.downloadSvg());
    this.listen(this.pngBtn, 'click', () => void this.downloadPng());
    this.listen(this.jsonBtn, 'click', () => this.downloadJson());
    this.listen(this.graph, 'mousemove', (e) => this.onMove(e));
    this.listen(this.graph, 'mouseleave', () => this.setHover(''));
    this.listen(this.graph, 'click', (e) => this.onClick(e));
  }

  /** The kernel's answer ends the wait for an exact ablation (its `exact`, or an error); the
   * state's supernodes replace the view's. */
  protected accept(state: GridState): void {
    const g = state.feature_graph ?? {};
    if (this.waiting) {
      const n = (g.nodes ?? []).find((x) => x.name === this.waiting);
      if (n && Number.isFinite(n.exact)) this.waiting = '';
    }
    if (state.detail?.error) this.waiting = '';
    this.groups = g.groups ?? [];
  }

  private graphPart(): FeatureGraph {
    return this.state?.feature_graph ?? {};
  }

  protected render(): void {
    const s = this.state;
    if (!s) return;
    const g = this.graphPart();
    const nodes = g.nodes ?? [];
    const others = nodes.filter((n) => n.kind !== 'metric').length;
    this.top.max = String(Math.max(1, others));
    this.filter.top = Math.min(this.filter.top, Math.max(1, others));
    this.top.value = String(this.filter.top);
    const { nodes: kept, edges } = filterGraph(g, this.filter);
    this.topLabel.textContent = `top ${kept.length - (nodes.length - others)} of ${others}${g.total && g.total > nodes.length ? ` drawn (${g.total} in all)` : ''}`;
    const checked = nodes.filter((n) => n.kind !== 'metric' && Number.isFinite(n.exact)).length;
    const parts = [s.message ? `${s.status}: ${s.message}` : s.status || 'done', `${kept.length} nodes, ${edges.length} edges drawn`, `${checked} checked by exact patches`];
    this.renderFrame(s, parts.join(' · '));
    this.root.setAttribute('data-checked', String(checked));
    this.groupBtn.disabled = this.selected.size === 0;
    this.drawGraph(g, kept, edges);
    this.drawGroups();
    this.renderDetail(s);
  }

  protected availWidth(): number {
    return Math.max(320, this.rootWidth(900) - 20);
  }

  private drawGraph(g: FeatureGraph, kept: number[], edges: FeatureEdge[]): void {
    const nodes = g.nodes ?? [];
    const layout = layoutFeatures(g, kept, this.measure());
    this.layout = layout;
    const el = this.graph;
    el.setAttribute('width', String(layout.width));
    el.setAttribute('height', String(layout.height));
    el.setAttribute('viewBox', `0 0 ${layout.width} ${layout.height}`);
    el.setAttribute('xmlns', SVG_NS);
    const sites = g.sites ?? [];
    const rows = svg('g', { class: 'pipatch-rows', 'font-size': 11, 'font-family': 'sans-serif', fill: '#616161' });
    [...sites, metricName(this.state)].forEach((name, row) => {
      const y = TOP + (sites.length - row) * layout.rowGap + 8 + SLOT / 2 + 4;
      rows.append(svg('text', { x: 4, y }, tooltipLabel(name, 16)));
    });
    const positions = g.positions ?? [];
    const cols = svg('g', { class: 'pipatch-cols', 'font-size': 10, 'font-family': 'sans-serif', fill: '#616161' });
    positions.forEach((p, c) => {
      const label = this.state?.col_labels[c] ?? String(p);
      cols.append(svg('text', { x: layout.left + c * layout.colWidth + 4, y: layout.height - 24 }, tooltipLabel(label, 10)));
      cols.append(svg('text', { x: layout.left + c * layout.colWidth + 4, y: layout.height - 12 }, `@${p}`));
    });
    const nodeMax = largest(nodes, kept);
    const edgeMax = Math.max(0, ...edges.map((e) => Math.abs(e.score)).filter(Number.isFinite)) || 1;
    const edgesG = svg('g', { class: 'pipatch-edges', fill: 'none' });
    const edgeIndex = new Map((g.edges ?? []).map((e, k) => [e, k]));
    for (const e of [...edges].sort((a, b) => Math.abs(a.score) - Math.abs(b.score))) {
      const a = layout.at.get(e.up);
      const b = layout.at.get(e.down);
      if (!a || !b) continue;
      const ends = { x1: a.x, y1: a.y, x2: b.x, y2: b.y, 'data-edge': edgeIndex.get(e) ?? -1 };
      const exact = Number.isFinite(e.exact);
      edgesG.append(svg('line', {
        class: 'pipatch-fedge', ...ends, 'data-up': e.up, 'data-down': e.down, 'data-exact': exact ? String(e.exact) : '',
        stroke: rgb(divergingColor(e.score, edgeMax)), 'stroke-width': 0.6 + 2.6 * Math.min(1, Math.abs(e.score) / edgeMax), 'stroke-opacity': 0.8,
      }));
      // A thin line is hard to point at: an invisible wider one over it takes the hover.
      edgesG.append(svg('line', { class: 'pipatch-fedge-hit', ...ends, stroke: '#000', 'stroke-opacity': 0, 'stroke-width': 8, 'pointer-events': 'stroke' }));
    }
    const nodesG = svg('g', { class: 'pipatch-fnodes' });
    const labels = svg('g', { class: 'pipatch-fnode-labels', 'font-size': 10, 'font-family': 'sans-serif', 'pointer-events': 'none' });
    for (const i of kept) {
      const n = nodes[i];
      const p = layout.at.get(i)!;
      const fill = n.kind === 'metric' ? '#757575' : rgb(divergingColor(n.score, nodeMax));
      const exact = Number.isFinite(n.exact);
      const sel = this.selected.has(n.name);
      const style = { fill, stroke: sel ? '#ff9800' : exact ? '#212121' : '#9e9e9e', 'stroke-width': sel ? 3 : exact ? 2 : 0.8 };
      const shape = n.kind === 'error'
        ? svg('rect', { x: p.x - p.r, y: p.y - p.r, width: 2 * p.r, height: 2 * p.r, ...style })
        : n.kind === 'metric'
          ? svg('polygon', { points: `${p.x},${p.y - p.r} ${p.x + p.r},${p.y} ${p.x},${p.y + p.r} ${p.x - p.r},${p.y}`, ...style })
          : svg('circle', { cx: p.x, cy: p.y, r: p.r, ...style });
      shape.setAttribute('class', `pipatch-fnode pipatch-fnode-${n.kind}`);
      shape.setAttribute('data-node', String(i));
      shape.setAttribute('data-name', n.name);
      shape.setAttribute('data-exact', exact ? String(n.exact) : '');
      if (sel) shape.classList.add('pipatch-fnode-selected');
      shape.append(svg('title', {}, n.name));
      nodesG.append(shape);
      if (n.name === this.clicked && exact) {
        labels.append(svg('text', { class: 'pipatch-fnode-exact', x: p.x + p.r + 2, y: p.y - p.r - 2, fill: '#212121' }, `exact ${formatValue(n.exact, 3)}`));
      }
    }
    const groupsG = svg('g', { class: 'pipatch-supernodes', fill: 'none', 'font-size': 10, 'font-family': 'sans-serif', 'pointer-events': 'none' });
    const index = new Map(nodes.map((n, i) => [n.name, i]));
    for (const grp of this.groups) {
      const pts = grp.nodes.map((name) => layout.at.get(index.get(name) ?? -1)).filter((p): p is Point & { r: number } => !!p);
      if (!pts.length) continue;
      const x0 = Math.min(...pts.map((p) => p.x - p.r)) - 4;
      const y0 = Math.min(...pts.map((p) => p.y - p.r)) - 4;
      const x1 = Math.max(...pts.map((p) => p.x + p.r)) + 4;
      const y1 = Math.max(...pts.map((p) => p.y + p.r)) + 4;
      const box = svg('g', { class: 'pipatch-supernode', 'data-group': grp.name });
      box.append(
        svg('rect', { x: x0, y: y0, width: x1 - x0, height: y1 - y0, rx: 6, stroke: '#ff9800', 'stroke-dasharray': '4 2' }),
        svg('text', { x: x0, y: y0 - 3, fill: '#e65100', stroke: 'none' }, tooltipLabel(grp.name, 30)),
      );
      groupsG.append(box);
    }
    el.replaceChildren(rows, cols, edgesG, groupsG, nodesG, labels);
    this.root.setAttribute('data-nodes', String(kept.length));
    this.root.setAttribute('data-edges', String(edges.length));
  }

  private drawGroups(): void {
    const items = this.groups.map((g) => {
      const row = h('div', 'pipatch-group-row');
      const remove = h('button', 'pipatch-ungroup', '×');
      remove.type = 'button';
      remove.title = 'remove this supernode';
      // Made again on every draw: a plain listener, gone with the button (not held until destroy).
      remove.addEventListener('click', () => this.sendGroup(g.name, []));
      row.append(h('span', 'pipatch-group-label', `${tooltipLabel(g.name, 40)}: ${g.nodes.map((n) => tooltipLabel(n, 40)).join(', ')}`), remove);
      return row;
    });
    this.groupsEl.replaceChildren(...(items.length ? [h('div', 'pipatch-groups-title', 'supernodes'), ...items] : []));
  }

  private nodeAt(target: EventTarget | null): number {
    const item = (target as Element | null)?.closest?.('.pipatch-fnode');
    return item ? Number(item.getAttribute('data-node')) : -1;
  }

  /** What is under the pointer: `n:<node index>`, `e:<edge index>`, or '' (nothing). */
  private hoverAt(target: EventTarget | null): string {
    const item = (target as Element | null)?.closest?.('.pipatch-fnode, .pipatch-fedge, .pipatch-fedge-hit');
    if (!item) return '';
    return item.classList.contains('pipatch-fnode') ? `n:${item.getAttribute('data-node')}` : `e:${item.getAttribute('data-edge')}`;
  }

  private setHover(key: string): void {
    if (this.hover === key) return;
    this.hover = key;
    const g = this.graphPart();
    const metric = this.state?.metric ?? '';
    const i = Number(key.slice(2));
    const node = key.startsWith('n:') ? g.nodes?.[i] : undefined;
    const edge = key.startsWith('e:') ? g.edges?.[i] : undefined;
    const lines = node ? nodeInfo(node, metric) : edge ? edgeInfo(edge, g.nodes ?? [], metric) : null;
    this.tip(lines);
  }

  private onMove(ev: MouseEvent): void {
    const key = this.hoverAt(ev.target);
    this.setHover(key);
    if (key) this.placeTip(ev);
  }

  private onClick(ev: MouseEvent): void {
    const n = this.graphPart().nodes?.[this.nodeAt(ev.target)];
    if (!n) return;
    if (ev.shiftKey) {
      if (this.selected.has(n.name)) this.selected.delete(n.name);
      else this.selected.add(n.name);
    } else {
      this.selected = new Set([n.name]);
      this.clicked = n.name;
      if (n.kind !== 'metric' && this.cb.live && this.cb.onAblate) {
        this.waiting = n.name;
        this.cb.onAblate(n.name);
      }
    }
    this.render();
  }

  private makeGroup(): void {
    const name = this.groupName.value.trim();
    if (!name || this.selected.size === 0) {
      this.groupName.focus();
      return;
    }
    this.sendGroup(name, [...this.selected]);
    this.groupName.value = '';
    this.selected.clear();
  }

  private sendGroup(name: string, members: string[]): void {
    this.groups = withGroup(this.groups, name, members);
    this.cb.onGroup?.(name, members);
    this.render();
  }

  private renderDetail(s: GridState): void {
    const n = (this.graphPart().nodes ?? []).find((x) => x.name === this.clicked);
    if (!n) {
      const hint = this.cb.live ? 'Click a node to ablate it exactly (its clean value patched in); shift-click nodes and Group them as a supernode.' : 'Shift-click nodes and Group them as a supernode.';
      this.detailEl.replaceChildren(h('div', 'pipatch-detail-hint', hint));
      return;
    }
    const kids = [h('div', 'pipatch-detail-head', nodeInfo(n, s.metric).join(' · '))];
    if (this.waiting === n.name) kids.push(h('div', 'pipatch-detail-running', 'exact ablation running…'));
    else if (Number.isFinite(n.exact)) kids.push(h('div', 'pipatch-detail-exact', `exact ablation: ${formatValue(n.exact, 4)} (change of ${s.metric || 'metric'})`));
    if (s.detail?.error) kids.push(h('div', 'pipatch-detail-error', s.detail.error));
    this.detailEl.replaceChildren(...kids);
  }

  /** The graph as a standalone SVG document (what the SVG and PNG buttons save). */
  svgText(): string {
    return standaloneSvg(this.graph);
  }

  /** The graph's data as JSON: the nodes drawn and all sent, edges and supernodes. */
  jsonText(): string {
    const s = this.state;
    const g = this.graphPart();
    const nodes = g.nodes ?? [];
    const num = (v: number) => (Number.isFinite(v) ? v : null);
    return JSON.stringify({
      title: s?.title ?? '', model: s?.model_name ?? '', metric: s?.metric ?? '', sites: g.sites ?? [], positions: g.positions ?? [],
      nodes: nodes.map((n) => ({ ...n, latent: num(n.latent), score: num(n.score), exact: num(n.exact) })),
      edges: (g.edges ?? []).map((e) => ({ upstream: nodes[e.up]?.name, downstream: nodes[e.down]?.name, score: num(e.score), exact: num(e.exact) })),
      supernodes: this.groups,
    }, null, 1);
  }

  downloadSvg(): void {
    if (this.state) this.save(new Blob([this.svgText()], { type: 'image/svg+xml' }), 'svg');
  }

  downloadJson(): void {
    if (this.state) this.save(new Blob([this.jsonText()], { type: 'application/json' }), 'json');
  }

  async downloadPng(): Promise<void> {
    if (!this.state || !this.layout) return;
    const { width, height } = this.layout;
    const url = URL.createObjectURL(new Blob([this.svgText()], { type: 'image/svg+xml' }));
    try {
      const img = new Image();
      await new Promise<void>((resolve, reject) => {
        img.onload = () => resolve();
        img.onerror = () => reject(new Error('the SVG did not load'));
        img.src = url;
      });
      const canvas = document.createElement('canvas');
      canvas.width = width * 2;
      canvas.height = height * 2;
      const ctx = canvas.getContext('2d');
      if (!ctx) return;
      ctx.scale(2, 2);
      ctx.drawImage(img, 0, 0, width, height);
      const blob = await new Promise<Blob | null>((resolve) => canvas.toBlob(resolve, 'image/png'));
      if (blob) this.save(blob, 'png');
    } finally {
      URL.revokeObjectURL(url);
    }
  }
}

function metricName(s: GridState | null): string {
  return s?.metric || 'metric';
}
