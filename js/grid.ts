/**
 * Framework-free canvas heatmap shared by the anywidget view (widget.ts) and the
 * JupyterLab MIME renderer (mime.ts).
 *
 * Every string that comes from a tokenizer, a user or the kernel is set with
 * `textContent` / `setAttribute` / canvas `fillText`; no HTML is ever parsed.
 */

import type { GridState, Mode, Selection, UiState } from './data';
import type { Span } from './format';
import { comparedValues, gridShape, holdsMetric, isComparison, matrixFor, modeChoices, seedLabel, selectMatrix } from './data';
import {
  NAN_RGB,
  barColor,
  buildCsv,
  cellAt,
  checksum32,
  computeLayout,
  doneSpan,
  formatValue,
  safeFileName,
  scaleColor,
  scaleKind,
  scaleRange,
  shortLabel,
  statusText,
  tooltipLabel,
  tooltipPlace,
  type Layout,
  type ScaleKind,
} from './format';
import { GRID_CSS } from './style';

export interface GridCallbacks {
  /** The user changed view / seed / mode. */
  onUiChange?(partial: Partial<UiState>): void;
  /** The user clicked a cell. */
  onSelect?(sel: Selection): void;
  /** The user pressed Stop. */
  onStop?(): void;
  /** Whether a kernel can answer cell clicks (top-5 predictions). */
  live?: boolean;
  /** A feature circuit: ask the kernel for a node's exact ablation (features.ts). */
  onAblate?(node: string): void;
  /** A feature circuit: the user named a group of nodes, a supernode (`nodes` empty: removed it). */
  onGroup?(name: string, nodes: string[]): void;
}

const ROW_LABEL_WIDTH = 96;
/** The subject's marks (as `SUBJECT_RGB` in `pipatch/_views/render.py`). */
const SUBJECT_RGB = '#b2182b';

export function h<K extends keyof HTMLElementTagNameMap>(tag: K, cls?: string, text?: string): HTMLElementTagNameMap[K] {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

/**
 * Show `tip` (a child of `box`, absolutely placed) beside the pointer of `ev`, inside `box`
 * (`tooltipPlace`): measured at the box's top left first, where its width does not depend on
 * where it was last.
 */
export function showTooltip(tip: HTMLElement, box: HTMLElement, ev: MouseEvent): void {
  tip.style.left = '0px';
  tip.style.top = '0px';
  tip.style.display = 'block';
  const rect = box.getBoundingClientRect();
  const place = tooltipPlace(ev.clientX - rect.left, ev.clientY - rect.top, tip.offsetWidth || 240, tip.offsetHeight, rect.width, rect.height);
  tip.style.left = `${place.left}px`;
  tip.style.top = `${place.top}px`;
}

let styleInstalled = false;
export function ensureStyle(el: HTMLElement): void {
  // One stylesheet per document; the CSS is a constant, set as text.
  const doc = el.ownerDocument || document;
  if (styleInstalled && doc.getElementById('pipatch-grid-style')) return;
  if (!doc.getElementById('pipatch-grid-style')) {
    const st = doc.createElement('style');
    st.id = 'pipatch-grid-style';
    st.textContent = GRID_CSS;
    (doc.head || doc.documentElement).appendChild(st);
  }
  styleInstalled = true;
}

export function cssVar(el: Element, name: string, fallback: string): string {
  try {
    const v = getComputedStyle(el).getPropertyValue(name).trim();
    return v || fallback;
  } catch {
    return fallback;
  }
}

export function ctx2d(c: HTMLCanvasElement): CanvasRenderingContext2D | null {
  try {
    return c.getContext('2d');
  } catch {
    return null;
  }
}

export const SVG_NS = 'http://www.w3.org/2000/svg';

/** An SVG element with attributes (and text, set as text). */
export function svg<K extends keyof SVGElementTagNameMap>(tag: K, attrs: Record<string, string | number> = {}, text?: string): SVGElementTagNameMap[K] {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

/** A colour triple as CSS. */
export const rgb = (c: [number, number, number]) => `rgb(${c[0]},${c[1]},${c[2]})`;

/** A drawn graph as a standalone SVG document on white (what the SVG and PNG buttons save),
 * less its elements of class `drop` (hit areas that only take the pointer). */
export function standaloneSvg(graph: SVGSVGElement, drop = ''): string {
  const copy = graph.cloneNode(true) as SVGSVGElement;
  if (drop) copy.querySelectorAll(`.${drop}`).forEach((p) => p.remove());
  copy.insertBefore(svg('rect', { width: '100%', height: '100%', fill: '#ffffff' }), copy.firstChild);
  return new XMLSerializer().serializeToString(copy);
}

/** Save `blob` as file `name` (a click on a hidden link inside `root`). */
export function downloadBlob(root: HTMLElement, blob: Blob, name: string): void {
  const url = URL.createObjectURL(blob);
  const a = document.createElement('a');
  a.href = url;
  a.download = name;
  a.style.display = 'none';
  root.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

/** The 160 × 10 colour bar of the scale `kind` from lo (left) to hi (right). */
export function drawColorBar(canvas: HTMLCanvasElement, kind: ScaleKind, lo: number, hi: number): void {
  const W = 160;
  const H = 10;
  if (canvas.width !== W) canvas.width = W;
  if (canvas.height !== H) canvas.height = H;
  const ctx = ctx2d(canvas);
  if (!ctx) return;
  for (let x = 0; x < W; x++) {
    const [r, g, b] = barColor(kind, (x + 0.5) / W);
    ctx.fillStyle = `rgb(${r},${g},${b})`;
    ctx.fillRect(x, 0, 1, H);
  }
  canvas.title =
    kind === 'diverging'
      ? `colour scale symmetric around 0: ${formatValue(lo)} … ${formatValue(hi)}`
      : kind === 'rank'
        ? `rank ${formatValue(lo)} (darkest: the top token) … ${formatValue(hi)}, on a log scale`
        : `colour scale from ${formatValue(lo)} (palest) to ${formatValue(hi)} (darkest)`;
}

/**
 * The detail pane's answer for a clicked cell `sel`: the kernel's error, or its top-5 table
 * when `s.detail` answers that cell; otherwise a line saying it is being asked (`live`) or
 * needs a live kernel. Everything as text.
 */
export function detailBody(s: GridState, sel: Selection, live: boolean): HTMLElement[] {
  const d = s.detail || {};
  const matches = d.row === sel.row && d.col === sel.col && (d.view === undefined || d.view === sel.view) && (d.seed === undefined || d.seed === sel.seed);
  if (matches && d.error) return [h('div', 'pipatch-detail-error', tooltipLabel(d.error))];
  if (matches && Array.isArray(d.top)) {
    const table = h('table', 'pipatch-top');
    const head = h('tr');
    head.append(h('th', undefined, 'next token'), h('th', undefined, 'probability'));
    table.append(head);
    for (const t of d.top.slice(0, 5)) {
      const tr = h('tr');
      tr.append(h('td', 'pipatch-top-token', tooltipLabel(t?.token ?? '', 60)), h('td', 'pipatch-top-prob', formatValue(Number(t?.prob), 4)));
      table.append(tr);
    }
    return [table];
  }
  if (live) return [h('div', 'pipatch-detail-hint', 'asking the kernel for the top-5 next tokens…')];
  return [h('div', 'pipatch-detail-hint', 'Top-5 next tokens need a live kernel (re-run the cell).')];
}

/** `Result.code()`: a Code button that shows a <pre> whose text is the script (never parsed
 * as HTML), with a Copy button; hidden when the state has no script. */
export class CodePanel {
  readonly button = h('button', 'pipatch-code-toggle', 'Code');
  readonly panel = h('div', 'pipatch-code');
  private copyBtn = h('button', 'pipatch-code-copy', 'Copy');
  private text = h('pre', 'pipatch-code-text');

  constructor(what: string) {
    this.button.title = `show a plain nnsight script that recomputes this ${what}`;
    this.copyBtn.title = 'copy the script to the clipboard';
    this.button.type = 'button';
    this.copyBtn.type = 'button';
    this.panel.append(this.copyBtn, this.text);
    this.panel.style.display = 'none';
    this.button.addEventListener('click', () => {
      this.panel.style.display = this.panel.style.display === 'none' ? '' : 'none';
    });
    this.copyBtn.addEventListener('click', () => this.copy());
  }

  update(code: string): void {
    this.button.style.display = code ? '' : 'none';
    if (!code) this.panel.style.display = 'none';
    if (this.text.textContent !== code) this.text.textContent = code;
  }

  /** Copy the script as text: the clipboard API where the page may use it, else select it for Ctrl-C. */
  copy(): void {
    const text = this.text.textContent ?? '';
    const done = () => {
      this.copyBtn.textContent = 'Copied';
      setTimeout(() => (this.copyBtn.textContent = 'Copy'), 1500);
    };
    const doc = this.panel.ownerDocument;
    const select = () => {
      const sel = doc.getSelection?.();
      if (!sel) return;
      const range = doc.createRange();
      range.selectNodeContents(this.text);
      sel.removeAllRanges();
      sel.addRange(range);
    };
    const clip = typeof navigator !== 'undefined' ? navigator.clipboard : undefined;
    if (clip?.writeText) clip.writeText(text).then(done, select);
    else select();
  }
}

export class GridView {
  readonly root: HTMLDivElement;
  private cb: GridCallbacks;
  private state: GridState | null = null;
  private ui: UiState = { view: '', seed: -1, mode: 'recovery', selected: {} };

  private titleEl = h('div', 'pipatch-title');
  private subtitleEl = h('div', 'pipatch-subtitle');
  private sidesEl = h('div', 'pipatch-sides');
  private toolbar = h('div', 'pipatch-toolbar');
  private viewSel = h('select', 'pipatch-view');
  private seedSel = h('select', 'pipatch-seed');
  private modeSel = h('select', 'pipatch-mode');
  private pngBtn = h('button', 'pipatch-png', 'PNG');
  private csvBtn = h('button', 'pipatch-csv', 'CSV');
  private stopBtn = h('button', 'pipatch-stop', 'Stop');
  /** Result.code(): a <pre> whose text is the script (never parsed as HTML), and a Copy button. */
  private code = new CodePanel('grid');
  private statusEl = h('div', 'pipatch-status');
  private warningsEl = h('ul', 'pipatch-warnings');
  private body = h('div', 'pipatch-body');
  private rowLabels = h('div', 'pipatch-rowlabels');
  private scroll = h('div', 'pipatch-scroll');
  private plot = h('div', 'pipatch-plot');
  private canvas = h('canvas', 'pipatch-heatmap');
  private overlay = h('canvas', 'pipatch-overlay');
  private colLabels = h('div', 'pipatch-collabels');
  private legend = h('div', 'pipatch-legend');
  private barCanvas = h('canvas', 'pipatch-colorbar');
  private barMin = h('span', 'pipatch-bar-min');
  private barMax = h('span', 'pipatch-bar-max');
  private barName = h('span', 'pipatch-bar-name');
  private detailEl = h('div', 'pipatch-detail');
  private tooltip = h('div', 'pipatch-tooltip');
  private errorsEl = h('div', 'pipatch-errors');

  private layout: Layout | null = null;
  private labelKey = '';
  private controlsKey = '';
  private kind: ScaleKind = 'diverging';
  /** The cells checked by an exact patch, [row, col], and the subject's columns: marked on the overlay. */
  private verified: [number, number][] = [];
  private subject: number[] = [];
  private range: [number, number] = [-1, 1];
  private hover: { row: number; col: number } | null = null;
  private stopClicked = false;
  private resizeObs: ResizeObserver | null = null;
  private lastWidth = 0;
  private offscreen: HTMLCanvasElement | null = null;
  private rafPending = false;

  constructor(el: HTMLElement, callbacks: GridCallbacks = {}) {
    this.cb = callbacks;
    ensureStyle(el);
    this.root = h('div', 'pipatch-grid');
    this.root.setAttribute('data-status', 'loading');

    const header = h('div', 'pipatch-header');
    header.append(this.titleEl, this.subtitleEl, this.sidesEl);

    this.pngBtn.title = 'download the heatmap as PNG';
    this.csvBtn.title = 'download the values as CSV';
    this.stopBtn.title = 'stop the sweep after the current chunk (keeps the partial grid)';
    for (const b of [this.pngBtn, this.csvBtn, this.stopBtn]) b.type = 'button';
    this.toolbar.append(this.viewSel, this.seedSel, this.modeSel, this.pngBtn, this.csvBtn, this.code.button, this.stopBtn);

    this.plot.append(this.canvas, this.overlay, this.colLabels);
    this.scroll.append(this.plot);
    this.body.append(this.rowLabels, this.scroll);

    const legendLabel = h('span', 'pipatch-bar-mid', '0');
    const barWrap = h('span', 'pipatch-bar-wrap');
    barWrap.append(this.barMin, this.barCanvas, this.barMax);
    const nanSw = h('span', 'pipatch-swatch pipatch-swatch-nan');
    const nanLbl = h('span', 'pipatch-legend-item', 'NaN (undefined)');
    const pendSw = h('span', 'pipatch-swatch pipatch-swatch-pending');
    const pendLbl = h('span', 'pipatch-legend-item', 'pending');
    this.legend.append(this.barName, barWrap, legendLabel, nanSw, nanLbl, pendSw, pendLbl);
    legendLabel.remove(); // the bar shows its ends; keep the DOM minimal

    this.root.append(
      header,
      this.toolbar,
      this.statusEl,
      this.warningsEl,
      this.errorsEl,
      this.code.panel,
      this.body,
      this.legend,
      this.detailEl,
      this.tooltip,
    );
    this.tooltip.style.display = 'none';
    el.appendChild(this.root);

    this.viewSel.addEventListener('change', () => this.changeUi({ view: this.viewSel.value, selected: {} }));
    this.seedSel.addEventListener('change', () => this.changeUi({ seed: Number(this.seedSel.value) }));
    this.modeSel.addEventListener('change', () => this.changeUi({ mode: this.modeSel.value as Mode }));
    this.pngBtn.addEventListener('click', () => this.downloadPng());
    this.csvBtn.addEventListener('click', () => this.downloadCsv());
    this.stopBtn.addEventListener('click', () => {
      this.stopClicked = true;
      this.stopBtn.disabled = true;
      this.stopBtn.textContent = 'Stopping…';
      this.cb.onStop?.();
    });
    this.overlay.addEventListener('mousemove', (e) => this.onMove(e));
    this.overlay.addEventListener('mouseleave', () => {
      this.hover = null;
      this.tooltip.style.display = 'none';
      this.drawOverlay();
    });
    this.overlay.addEventListener('click', (e) => this.onClick(e));

    if (typeof ResizeObserver !== 'undefined') {
      this.resizeObs = new ResizeObserver(() => {
        const w = this.availWidth();
        if (Math.abs(w - this.lastWidth) > 4 && this.state) this.scheduleRender();
      });
      this.resizeObs.observe(this.root);
    }
  }

  destroy(): void {
    this.resizeObs?.disconnect();
    this.root.remove();
  }

  /** Draw `state` with the UI choices `ui`; cheap enough to call on every update. */
  update(state: GridState, ui: Partial<UiState> = {}): void {
    this.state = state;
    this.ui = { ...this.ui, ...ui };
    if (!state.views.includes(this.ui.view)) this.ui.view = state.views[0] ?? '';
    if (this.ui.seed >= state.n_seeds) this.ui.seed = -1;
    const modes = modeChoices(state);
    if (!modes.some(([m]) => m === this.ui.mode)) this.ui.mode = modes[0][0];
    this.render();
  }

  getUi(): UiState {
    return { ...this.ui };
  }

  private option(value: string, text: string): HTMLOptionElement {
    const o = document.createElement('option');
    o.value = value;
    o.textContent = text;
    return o;
  }

  private changeUi(partial: Partial<UiState>): void {
    this.ui = { ...this.ui, ...partial };
    this.cb.onUiChange?.(partial);
    this.render();
  }

  private scheduleRender(): void {
    if (this.rafPending) return;
    this.rafPending = true;
    const raf = typeof requestAnimationFrame === 'function' ? requestAnimationFrame : (f: () => void) => setTimeout(f, 16);
    raf(() => {
      this.rafPending = false;
      this.render();
    });
  }

  private availWidth(): number {
    const w = this.root.clientWidth || (this.root.parentElement?.clientWidth ?? 0);
    return (w > 0 ? w : 800) - ROW_LABEL_WIDTH - 16;
  }

  private render(): void {
    const s = this.state;
    if (!s) return;
    this.root.setAttribute('data-status', s.status);
    this.titleEl.textContent = s.title || 'pipatch';
    const sub = [s.kind, s.model_name, s.metric ? `metric: ${s.metric}` : ''].filter(Boolean);
    const bl = Object.entries(s.baselines)
      .map(([k, v]) => `${k} ${formatValue(v)}`)
      .join(', ');
    if (bl) sub.push(bl);
    this.subtitleEl.textContent = sub.join(' · ');
    this.sidesEl.replaceChildren(...s.sides.map((side) => h('div', 'pipatch-side', tooltipLabel(side))));
    this.renderControls(s);
    this.statusEl.textContent = statusText(s);
    this.statusEl.setAttribute('data-status', s.status);
    this.renderWarnings(s);
    this.code.update(s.code);
    this.renderGrid(s);
    this.renderDetail(s);
  }

  private renderControls(s: GridState): void {
    const modes = modeChoices(s);
    const key = JSON.stringify([s.views, s.n_seeds, s.seed_noun, s.seed_labels, modes]);
    if (key !== this.controlsKey) {
      this.controlsKey = key;
      this.viewSel.replaceChildren(...s.views.map((v) => this.option(v, v)));
      this.modeSel.replaceChildren(...modes.map(([m, name]) => this.option(m, name)));
      this.modeSel.title = isComparison(s)
        ? `show a − b, or one side, of ${comparedValues(s)}`
        : 'colour by normalized recovery or by the raw metric';
      const seeds = [this.option('-1', seedLabel(s, -1))];
      for (let i = 0; i < s.n_seeds; i++) seeds.push(this.option(String(i), shortLabel(seedLabel(s, i), 60)));
      this.seedSel.replaceChildren(...seeds);
    }
    this.viewSel.style.display = s.views.length > 1 ? '' : 'none';
    this.seedSel.style.display = s.n_seeds > 1 ? '' : 'none';
    this.viewSel.value = this.ui.view;
    this.seedSel.value = String(this.ui.seed);
    this.modeSel.value = this.ui.mode;
    const showStop = s.stoppable && s.status === 'running';
    this.stopBtn.style.display = showStop ? '' : 'none';
    if (!showStop) {
      this.stopClicked = false;
      this.stopBtn.disabled = false;
      this.stopBtn.textContent = 'Stop';
    } else if (this.stopClicked) {
      this.stopBtn.disabled = true;
    }
  }

  /** Copy the script as text (see `CodePanel.copy`). */
  copyCode(): void {
    this.code.copy();
  }

  private renderWarnings(s: GridState): void {
    const items = s.warnings.map((w) => h('li', 'pipatch-warning', `⚠ ${w}`));
    this.warningsEl.replaceChildren(...items);
    this.warningsEl.style.display = items.length ? '' : 'none';
  }

  private matrix() {
    const s = this.state!;
    return selectMatrix(s, this.ui.view, this.ui.seed, this.ui.mode);
  }

  private doneSpan(rows: number): Span {
    return doneSpan(this.state!, this.ui.view, rows);
  }

  private isDone(row: number, rows: number): boolean {
    const [from, to] = this.doneSpan(rows);
    return row >= from && row < to;
  }

  private renderGrid(s: GridState): void {
    const m = this.matrix();
    const { rows, cols } = m;
    const avail = this.availWidth();
    this.lastWidth = avail;
    const maxChars = Math.min(14, s.col_labels.reduce((a, l) => Math.max(a, Math.min(l.length, 14)), 1));
    const layout = computeLayout(rows, cols, avail, { maxLabelChars: maxChars });
    this.layout = layout;
    const done = this.doneSpan(rows);
    this.kind = scaleKind(s, this.ui.mode);
    this.range = scaleRange(s, this.ui.view, this.ui.mode, m, done);
    this.root.setAttribute('data-scale', this.kind);
    const verified = matrixFor(s, `${this.ui.view}/verified`, rows, cols);
    this.verified = [];
    if (verified) for (let i = 0; i < verified.length; i++) if (verified[i] > 0) this.verified.push([Math.floor(i / cols), i % cols]);
    this.subject = s.subject.filter((c) => c >= 0 && c < cols);
    this.root.setAttribute('data-verified', String(this.verified.length));
    this.root.setAttribute('data-subject', this.subject.join(','));

    // Canvas backing store: device pixels when affordable.
    const dprWanted = Math.min(typeof devicePixelRatio === 'number' ? devicePixelRatio : 1, 2);
    const dpr = layout.width * layout.height * dprWanted * dprWanted < 16e6 ? dprWanted : 1;
    for (const c of [this.canvas, this.overlay]) {
      const bw = Math.max(1, Math.round(layout.width * dpr));
      const bh = Math.max(1, Math.round(layout.height * dpr));
      if (c.width !== bw) c.width = bw;
      if (c.height !== bh) c.height = bh;
      c.style.width = `${layout.width}px`;
      c.style.height = `${layout.height}px`;
    }
    this.plot.style.width = `${layout.width}px`;
    this.plot.style.height = `${layout.height + layout.colLabelHeight}px`;
    this.colLabels.style.top = `${layout.height}px`;
    this.colLabels.style.height = `${layout.colLabelHeight}px`;
    this.rowLabels.style.height = `${layout.height}px`;
    this.rowLabels.style.width = `${ROW_LABEL_WIDTH}px`;
    this.root.setAttribute('data-rows', String(rows));
    this.root.setAttribute('data-cols', String(cols));
    this.root.setAttribute('data-rows-done', String(done[1] - done[0]));
    this.root.setAttribute('data-checksum', checksum32(m.data));

    this.drawHeatmap(m.data, rows, cols, done, dpr);
    this.renderLabels(s, rows, cols, layout);
    this.renderLegend();
    this.drawOverlay();
  }

  private drawHeatmap(data: Float32Array | null, rows: number, cols: number, done: Span, dpr: number): void {
    const ctx = ctx2d(this.canvas);
    const layout = this.layout!;
    if (!ctx) return;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
    if (rows === 0 || cols === 0) return;
    // One pixel per cell, then scaled up without smoothing: O(cells), not O(pixels).
    if (!this.offscreen) this.offscreen = document.createElement('canvas');
    const off = this.offscreen;
    if (off.width !== cols) off.width = cols;
    if (off.height !== rows) off.height = rows;
    const octx = ctx2d(off);
    if (!octx) return;
    const img = octx.createImageData(cols, rows);
    const px = img.data;
    const [lo, hi] = this.range;
    for (let i = done[0] * cols; i < done[1] * cols; i++) {
      const v = data ? data[i] : NaN;
      const [r, g, b] = scaleColor(v, this.kind, lo, hi);
      const o = i * 4;
      px[o] = r;
      px[o + 1] = g;
      px[o + 2] = b;
      px[o + 3] = 255;
    }
    octx.putImageData(img, 0, 0);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, 0, 0, cols, rows, 0, 0, layout.width, layout.height);
    // Pending rows, above or below the finished band: diagonal hatching in theme colours,
    // distinct from the grey used for NaN.
    for (const [r0, r1] of [[0, done[0]], [done[1], rows]]) {
      if (r0 >= r1) continue;
      const y0 = r0 * layout.cellH;
      const hgt = (r1 - r0) * layout.cellH;
      ctx.fillStyle = cssVar(this.root, '--jp-layout-color2', '#eeeeee');
      ctx.fillRect(0, y0, layout.width, hgt);
      ctx.strokeStyle = cssVar(this.root, '--jp-border-color1', '#bdbdbd');
      ctx.lineWidth = 1;
      ctx.save();
      ctx.beginPath();
      ctx.rect(0, y0, layout.width, hgt);
      ctx.clip();
      ctx.beginPath();
      for (let x = -hgt; x < layout.width; x += 8) {
        ctx.moveTo(x, y0 + hgt);
        ctx.lineTo(x + hgt, y0);
      }
      ctx.stroke();
      ctx.restore();
    }
  }

  private renderLabels(s: GridState, rows: number, cols: number, layout: Layout): void {
    const key = [s.subject.join(','), rows, cols, layout.cellW, layout.cellH, layout.colStride, layout.rowStride, s.row_labels.length, s.col_labels.length, s.row_labels.join('\u0001').length, s.col_labels.join('\u0001')].join('|');
    if (key === this.labelKey) return;
    this.labelKey = key;
    const rowEls: HTMLElement[] = [];
    const fontRow = Math.max(8, Math.min(12, layout.cellH * layout.rowStride - 1));
    for (let r = 0; r < rows; r += layout.rowStride) {
      const full = s.row_labels[r] ?? String(r);
      const e = h('div', 'pipatch-rowlabel', shortLabel(full, 14));
      e.style.top = `${r * layout.cellH}px`;
      e.style.height = `${layout.cellH}px`;
      e.style.lineHeight = `${layout.cellH}px`;
      e.style.fontSize = `${Math.min(fontRow, 12)}px`;
      e.title = tooltipLabel(full);
      rowEls.push(e);
    }
    this.rowLabels.replaceChildren(...rowEls);
    const colEls: HTMLElement[] = [];
    const subject = new Set(s.subject);
    for (let c = 0; c < cols; c += layout.colStride) {
      const full = s.col_labels[c] ?? String(c);
      const e = h('div', layout.rotateCols ? 'pipatch-collabel pipatch-rot' : 'pipatch-collabel', shortLabel(full, layout.rotateCols ? 14 : Math.max(4, Math.floor(layout.cellW / 7))));
      e.setAttribute('data-col', String(c));
      e.title = tooltipLabel(full);
      if (subject.has(c)) {
        e.classList.add('pipatch-subject');
        e.title += ' (subject)';
      }
      if (layout.rotateCols) {
        e.style.left = `${(c + 0.5) * layout.cellW + 6}px`;
      } else {
        e.style.left = `${c * layout.cellW}px`;
        e.style.width = `${layout.cellW}px`;
      }
      colEls.push(e);
    }
    this.colLabels.replaceChildren(...colEls);
  }

  private renderLegend(): void {
    const [lo, hi] = this.range;
    this.barName.textContent = this.valuesName();
    this.barMin.textContent = this.bound(lo);
    this.barMax.textContent = this.bound(hi);
    drawColorBar(this.barCanvas, this.kind, lo, hi);
  }

  /** A colour bar's end as written: a rank whole. */
  private bound(v: number): string {
    return this.kind === 'rank' ? String(Math.round(v)) : formatValue(v, 2);
  }

  /** What the drawn cells are, in words (the colour bar's name). */
  private valuesName(): string {
    const s = this.state;
    if (s && isComparison(s)) return `${this.ui.mode === 'a' || this.ui.mode === 'b' ? this.ui.mode : 'a − b'}: ${comparedValues(s)}`;
    if (s && holdsMetric(s)) return s.metric || 'metric';
    return this.ui.mode === 'raw' ? `raw ${s?.metric || 'metric'}` : 'normalized recovery';
  }

  private drawOverlay(): void {
    const layout = this.layout;
    const ctx = ctx2d(this.overlay);
    if (!ctx || !layout) return;
    const dpr = this.overlay.width / Math.max(1, layout.width);
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, this.overlay.width, this.overlay.height);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    const sel = this.ui.selected as Partial<Selection>;
    const mark = (row: number, col: number, color: string, w: number) => {
      ctx.strokeStyle = color;
      ctx.lineWidth = w;
      const x = col * layout.cellW;
      const y = row * layout.cellH;
      ctx.strokeRect(x + w / 2, y + w / 2, Math.max(layout.cellW - w, 1), Math.max(layout.cellH - w, 1));
    };
    // Cells checked by an exact patch: black on a white halo (as the figure's □), seen on any cell.
    for (const [row, col] of this.verified) {
      mark(row, col, '#ffffff', 3);
      mark(row, col, '#000000', 1);
    }
    // The subject's columns: a ▲ at the heatmap's foot (as the figure's), seen when labels are thinned.
    ctx.fillStyle = SUBJECT_RGB;
    for (const c of this.subject) {
      const x = (c + 0.5) * layout.cellW;
      const half = Math.max(2, Math.min(5, layout.cellW / 2 - 1));
      ctx.beginPath();
      ctx.moveTo(x - half, layout.height);
      ctx.lineTo(x + half, layout.height);
      ctx.lineTo(x, layout.height - half * 1.6);
      ctx.closePath();
      ctx.fill();
    }
    if (sel && sel.view === this.ui.view && typeof sel.row === 'number' && typeof sel.col === 'number') {
      mark(sel.row, sel.col, cssVar(this.root, '--jp-ui-font-color0', '#000000'), 2);
    }
    if (this.hover) mark(this.hover.row, this.hover.col, cssVar(this.root, '--jp-brand-color1', '#1976d2'), 1);
  }

  private eventCell(e: MouseEvent): { row: number; col: number } | null {
    const layout = this.layout;
    if (!layout || !this.state) return null;
    const rect = this.overlay.getBoundingClientRect();
    const m = this.matrix();
    return cellAt(e.clientX - rect.left, e.clientY - rect.top, layout, m.rows, m.cols);
  }

  private onMove(e: MouseEvent): void {
    const cell = this.eventCell(e);
    if (!cell) {
      this.hover = null;
      this.tooltip.style.display = 'none';
      this.drawOverlay();
      return;
    }
    if (!this.hover || this.hover.row !== cell.row || this.hover.col !== cell.col) {
      this.hover = cell;
      this.fillTooltip(cell.row, cell.col);
      this.drawOverlay();
    }
    showTooltip(this.tooltip, this.root, e);
  }

  /** Tooltip lines for one cell (also used by tests); `notes`: the row's note lines too (the
   * tooltip's; the detail pane's one-line head leaves them out). */
  cellInfo(row: number, col: number, notes = true): string[] {
    const s = this.state!;
    const m = this.matrix();
    const { rows, cols } = m;
    const lines: string[] = [];
    const i = row * cols + col;
    lines.push(`${s.row_axis || 'layer'}: ${tooltipLabel(s.row_labels[row] ?? String(row))}`);
    // A row's note (a latent's label, its top contexts) is text, one line per line, escaped like every label.
    if (notes) for (const note of (s.row_notes[row] ?? '').split('\n')) if (note) lines.push(tooltipLabel(note, 160));
    // A cell's own note (a feature read: the latent at this rank and position, its label and contexts), the same way.
    if (notes) for (const note of (s.cell_notes[this.ui.view]?.[i] ?? '').split('\n')) if (note) lines.push(tooltipLabel(note, 160));
    lines.push(`${s.col_axis === 'head' ? 'head' : 'token'} ${col}: ${tooltipLabel(s.col_labels[col] ?? String(col))}${s.subject.includes(col) ? ' (subject)' : ''}`);
    if (!this.isDone(row, rows)) {
      lines.push('pending (not computed yet)');
      return lines;
    }
    if (isComparison(s)) {
      const [diff, a, b] = (['diff', 'a', 'b'] as const).map((m) => selectMatrix(s, this.ui.view, -1, m).data);
      lines.push(`a − b: ${formatValue(diff ? diff[i] : NaN)} (${comparedValues(s)})`);
      lines.push(`a: ${formatValue(a ? a[i] : NaN)}`, `b: ${formatValue(b ? b[i] : NaN)}`);
      return lines;
    }
    const rec = selectMatrix(s, this.ui.view, this.ui.seed, 'recovery').data;
    const raw = selectMatrix(s, this.ui.view, this.ui.seed, 'raw').data;
    const std = this.ui.seed < 0 && s.n_seeds > 1 ? matrixFor(s, `${this.ui.view}/std`, rows, cols) : null;
    if (holdsMetric(s)) {
      if (rec) lines.push(`${s.metric || 'metric'}: ${formatValue(rec[i])}`);
    } else if (rec) {
      let t = `recovery: ${formatValue(rec[i])}`;
      if (std && Number.isFinite(std[i])) t += ` ± ${formatValue(std[i])}`;
      lines.push(t);
    }
    if (raw && !holdsMetric(s)) lines.push(`raw ${s.metric || 'metric'}: ${formatValue(raw[i])}`);
    const ver = matrixFor(s, `${this.ui.view}/verified`, rows, cols);
    if (ver && ver[i]) lines.push('verified by a real patch');
    if (this.ui.seed >= 0 || s.n_seeds > 1) lines.push(tooltipLabel(seedLabel(s, this.ui.seed)));
    return lines;
  }

  private fillTooltip(row: number, col: number): void {
    this.tooltip.replaceChildren(...this.cellInfo(row, col).map((l) => h('div', 'pipatch-tip-line', l)));
  }

  private onClick(e: MouseEvent): void {
    const cell = this.eventCell(e);
    const s = this.state;
    if (!cell || !s) return;
    if (!this.isDone(cell.row, this.matrix().rows)) return;
    const sel: Selection = { view: this.ui.view, seed: this.ui.seed, row: cell.row, col: cell.col };
    this.ui = { ...this.ui, selected: sel };
    this.cb.onUiChange?.({ selected: sel });
    this.cb.onSelect?.(sel);
    this.drawOverlay();
    this.renderDetail(s);
  }

  private renderDetail(s: GridState): void {
    const sel = this.ui.selected as Partial<Selection>;
    if (typeof sel.row !== 'number' || typeof sel.col !== 'number') {
      // A comparison has no patched run of its own: its sides' grids have the top-5.
      this.detailEl.replaceChildren(h('div', 'pipatch-detail-hint', this.cb.live && !isComparison(s) ? 'Click a cell to see the patched run’s top-5 next tokens.' : ''));
      return;
    }
    const kids: HTMLElement[] = [];
    kids.push(h('div', 'pipatch-detail-head', this.cellInfo(sel.row, sel.col, false).join(' · ')));
    kids.push(...detailBody(s, sel as Selection, !!this.cb.live));
    this.detailEl.replaceChildren(...kids);
  }

  /** A standalone PNG of the current view: title, labels, heatmap, colour bar. */
  composeCanvas(): HTMLCanvasElement | null {
    const s = this.state;
    const layout = this.layout;
    if (!s || !layout) return null;
    const m = this.matrix();
    const cellW = Math.max(layout.cellW, 4);
    const cellH = Math.max(layout.cellH, 4);
    const left = 110;
    const top = 40;
    const gw = Math.min(Math.ceil(cellW * m.cols), 30000);
    const gh = Math.ceil(cellH * m.rows);
    const bottom = 130;
    const c = document.createElement('canvas');
    c.width = left + gw + 20;
    c.height = top + gh + bottom;
    const ctx = ctx2d(c);
    if (!ctx) return null;
    ctx.fillStyle = '#ffffff';
    ctx.fillRect(0, 0, c.width, c.height);
    ctx.fillStyle = '#000000';
    ctx.font = 'bold 14px sans-serif';
    ctx.fillText(shortLabel(s.title || 'pipatch', 120), 8, 20);
    ctx.font = '11px sans-serif';
    ctx.fillText(shortLabel(`${this.ui.view} · ${this.ui.mode} · ${seedLabel(s, this.ui.seed)}`, 120), 8, 34);
    if (this.offscreen) {
      ctx.imageSmoothingEnabled = false;
      const [from, to] = this.doneSpan(m.rows);
      if (to > from) ctx.drawImage(this.offscreen, 0, from, m.cols, to - from, left, top + from * cellH, gw, (to - from) * cellH);
      ctx.fillStyle = '#eeeeee';
      ctx.fillRect(left, top, gw, from * cellH);
      ctx.fillRect(left, top + to * cellH, gw, gh - to * cellH);
    }
    ctx.fillStyle = '#000000';
    const rowStride = Math.max(1, Math.ceil(12 / cellH));
    for (let r = 0; r < m.rows; r += rowStride) {
      ctx.fillText(shortLabel(s.row_labels[r] ?? String(r), 14), 4, top + (r + 0.5) * cellH + 4);
    }
    const colStride = Math.max(1, Math.ceil(13 / cellW));
    for (let col = 0; col < m.cols; col += colStride) {
      ctx.save();
      ctx.translate(left + (col + 0.5) * cellW - 4, top + gh + 4);
      ctx.rotate(Math.PI / 2);
      ctx.fillStyle = s.subject.includes(col) ? SUBJECT_RGB : '#000000';
      ctx.fillText(shortLabel(s.col_labels[col] ?? String(col), 16), 0, 0);
      ctx.restore();
    }
    const by = top + gh + 110;
    for (let x = 0; x < 160; x++) {
      const [r, g, b] = barColor(this.kind, (x + 0.5) / 160);
      ctx.fillStyle = `rgb(${r},${g},${b})`;
      ctx.fillRect(left + x, by, 1, 10);
    }
    ctx.fillStyle = '#000000';
    ctx.fillText(this.bound(this.range[0]), left - 44, by + 9);
    ctx.fillText(this.bound(this.range[1]), left + 166, by + 9);
    ctx.fillStyle = `rgb(${NAN_RGB.join(',')})`;
    ctx.fillRect(left + 230, by, 10, 10);
    ctx.fillStyle = '#000000';
    ctx.fillText('NaN', left + 244, by + 9);
    return c;
  }

  private download(blob: Blob, name: string): void {
    downloadBlob(this.root, blob, name);
  }

  downloadPng(): void {
    const c = this.composeCanvas();
    if (!c) return;
    c.toBlob((blob) => {
      if (blob) this.download(blob, safeFileName(this.state?.title ?? '', 'png'));
    }, 'image/png');
  }

  downloadCsv(): void {
    const s = this.state;
    if (!s) return;
    const csv = buildCsv(s, this.ui.view, this.ui.seed);
    this.download(new Blob([csv], { type: 'text/csv' }), safeFileName(`${s.title}_${this.ui.view}`, 'csv'));
  }

  /** Show a decoding problem without breaking the rest of the grid. */
  setErrors(errors: string[]): void {
    this.errorsEl.replaceChildren(...errors.map((e) => h('div', 'pipatch-error', e)));
  }
}

export { gridShape };
