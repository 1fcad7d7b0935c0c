/**
 * The grid: a framework-free canvas heatmap of a state's matrices, on the lifecycle of the
 * one view base (view.ts), drawn by the anywidget view (widget.ts) and the JupyterLab MIME
 * renderer (mime.ts) alike.
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
  scaleColor,
  scaleKind,
  scaleRange,
  shortLabel,
  statusText,
  tooltipLabel,
  type Layout,
  type ScaleKind,
} from './format';
import { ctx2d, cssVar, drawColorBar, h } from './dom';
import { CodePanel, detailBody, StopButton, View, type GridCallbacks } from './view';

const ROW_LABEL_WIDTH = 96;
/** The subject's marks (as `SUBJECT_RGB` in `pipatch/_results/views/render.py`). */
const SUBJECT_RGB = '#b2182b';

/** A state's matrices as a heatmap, one view / seed / mode at a time; a click on a cell asks
 * the kernel for that patched run's top-5. */
export class GridView extends View {
  private sidesEl = h('div', 'pipatch-sides');
  private viewSel = h('select', 'pipatch-view');
  private seedSel = h('select', 'pipatch-seed');
  private modeSel = h('select', 'pipatch-mode');
  private pngBtn = h('button', 'pipatch-png', 'PNG');
  private csvBtn = h('button', 'pipatch-csv', 'CSV');
  private stop = new StopButton('stop the sweep after the current chunk (keeps the partial grid)', () => this.cb.onStop?.(), this.signal);
  /** Result.code(): a <pre> whose text is the script (never parsed as HTML), and a Copy button. */
  private code = new CodePanel('grid', this.signal);
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

  private layout: Layout | null = null;
  private labelKey = '';
  private controlsKey = '';
  private kind: ScaleKind = 'diverging';
  /** The cells checked by an exact patch, [row, col], and the subject's columns: marked on the overlay. */
  private verified: [number, number][] = [];
  private subject: number[] = [];
  private range: [number, number] = [-1, 1];
  private hover: { row: number; col: number } | null = null;
  private offscreen: HTMLCanvasElement | null = null;

  constructor(el: HTMLElement, callbacks: GridCallbacks = {}) {
    super(el, callbacks);
    this.pngBtn.title = 'download the heatmap as PNG';
    this.csvBtn.title = 'download the values as CSV';
    for (const b of [this.pngBtn, this.csvBtn]) b.type = 'button';
    this.toolbar.append(this.viewSel, this.seedSel, this.modeSel, this.pngBtn, this.csvBtn, this.code.button, this.stop.button);

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

    this.mount(el, [this.code.panel, this.body, this.legend], [this.sidesEl]);

    this.listen(this.viewSel, 'change', () => this.changeUi({ view: this.viewSel.value, selected: {} }));
    this.listen(this.seedSel, 'change', () => this.changeUi({ seed: Number(this.seedSel.value) }));
    this.listen(this.modeSel, 'change', () => this.changeUi({ mode: this.modeSel.value as Mode }));
    this.listen(this.pngBtn, 'click', () => this.downloadPng());
    this.listen(this.csvBtn, 'click', () => this.downloadCsv());
    this.listen(this.overlay, 'mousemove', (e) => this.onMove(e));
    this.listen(this.overlay, 'mouseleave', () => {
      this.hover = null;
      this.tip(null);
      this.drawOverlay();
    });
    this.listen(this.overlay, 'click', (e) => this.onClick(e));
  }

  /** A seed or mode the new state lacks falls back to the mean, the first mode. */
  protected accept(state: GridState): void {
    if (this.ui.seed >= state.n_seeds) this.ui.seed = -1;
    const modes = modeChoices(state);
    if (!modes.some(([m]) => m === this.ui.mode)) this.ui.mode = modes[0][0];
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

  protected availWidth(): number {
    return this.rootWidth(800) - ROW_LABEL_WIDTH - 16;
  }

  protected render(): void {
    const s = this.state;
    if (!s) return;
    this.renderFrame(s, statusText(s));
    this.sidesEl.replaceChildren(...s.sides.map((side) => h('div', 'pipatch-side', tooltipLabel(side))));
    this.renderControls(s);
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
    this.stop.update(s);
  }

  /** Copy the script as text (see `CodePanel.copy`). */
  copyCode(): void {
    this.code.copy();
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
    const avail = this.measure();
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
      this.tip(null);
      this.drawOverlay();
      return;
    }
    if (!this.hover || this.hover.row !== cell.row || this.hover.col !== cell.col) {
      this.hover = cell;
      this.fillTooltip(cell.row, cell.col);
      this.drawOverlay();
    }
    this.placeTip(e);
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
    this.tip(this.cellInfo(row, col));
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

  downloadPng(): void {
    const c = this.composeCanvas();
    if (!c) return;
    c.toBlob((blob) => {
      if (blob) this.save(blob, 'png');
    }, 'image/png');
  }

  downloadCsv(): void {
    const s = this.state;
    if (!s) return;
    const csv = buildCsv(s, this.ui.view, this.ui.seed);
    this.save(new Blob([csv], { type: 'text/csv' }), 'csv', `${s.title}_${this.ui.view}`);
  }
}

export { gridShape };

