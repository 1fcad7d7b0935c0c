/**
 * The one view base: what every view of a state (the grid, grid.ts; a circuit's graph,
 * circuit.ts; a feature circuit's graph, features.ts) does the same way, written once.
 *
 * A view is made in a host element, drawn from a whole state on every `update`, and ended by
 * `destroy`. `View` owns that lifecycle: the root (`pipatch-grid` plus the view's own class,
 * `data-status`), the frame around the drawing (title and subtitle, toolbar, status line,
 * warnings, errors, detail pane, tooltip), the resize observer that draws again, once a frame,
 * when the width to draw at moves, the listeners (all removed by `destroy`), and saving a
 * file named after the title. A view adds its controls to `toolbar`, its drawing to `mount`,
 * what it derives from a state in `accept`, and draws in `render`.
 *
 * The pieces two views share are here too: the Code panel (`Result.code()`), the Stop button
 * and the detail pane's top-5 table. Which view draws a state is views.ts's `viewFor`.
 */

import type { GridState, Selection, UiState } from './data';
import { formatValue, safeFileName, tooltipLabel } from './format';
import { downloadBlob, ensureStyle, h, showTooltip } from './dom';

/** What a view tells its host (the live widget, the saved document's renderer). */
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

  constructor(what: string, signal?: AbortSignal) {
    this.button.title = `show a plain nnsight script that recomputes this ${what}`;
    this.copyBtn.title = 'copy the script to the clipboard';
    this.button.type = 'button';
    this.copyBtn.type = 'button';
    this.panel.append(this.copyBtn, this.text);
    this.panel.style.display = 'none';
    this.button.addEventListener('click', () => {
      this.panel.style.display = this.panel.style.display === 'none' ? '' : 'none';
    }, { signal });
    this.copyBtn.addEventListener('click', () => this.copy(), { signal });
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

/** The Stop button of a running computation: shown while the state is running and
 * stoppable; a click disables it, says "Stopping…" and calls `onStop` once. */
export class StopButton {
  readonly button = h('button', 'pipatch-stop', 'Stop');
  private clicked = false;

  constructor(title: string, onStop: () => void, signal?: AbortSignal) {
    this.button.title = title;
    this.button.type = 'button';
    this.button.addEventListener('click', () => {
      this.clicked = true;
      this.button.disabled = true;
      this.button.textContent = 'Stopping…';
      onStop();
    }, { signal });
  }

  update(s: GridState): void {
    const show = s.stoppable && s.status === 'running';
    this.button.style.display = show ? '' : 'none';
    if (!show) {
      this.clicked = false;
      this.button.disabled = false;
      this.button.textContent = 'Stop';
    } else if (this.clicked) this.button.disabled = true;
  }
}

/** What widget.ts and mime.ts draw a state with (views.ts's `viewFor` picks which). */
export interface StateView {
  update(state: GridState, ui?: Partial<UiState>): void;
  setErrors(errors: string[]): void;
  destroy(): void;
}

/**
 * The lifecycle every view shares. A subclass builds its own elements, then calls `mount`
 * with them; it draws the whole state in `render` (the frame by `renderFrame`) and takes its
 * margins off `rootWidth` in `availWidth`.
 */
export abstract class View implements StateView {
  readonly root: HTMLDivElement;
  protected readonly cb: GridCallbacks;
  protected state: GridState | null = null;
  protected ui: UiState = { view: '', seed: -1, mode: 'recovery', selected: {} };
  /** Ends every listener `listen` added (and the Code panel's and Stop button's) on `destroy`. */
  private readonly listeners = new AbortController();
  protected readonly signal = this.listeners.signal;

  protected readonly titleEl = h('div', 'pipatch-title');
  protected readonly subtitleEl = h('div', 'pipatch-subtitle');
  protected readonly toolbar = h('div', 'pipatch-toolbar');
  protected readonly statusEl = h('div', 'pipatch-status');
  protected readonly warningsEl = h('ul', 'pipatch-warnings');
  protected readonly errorsEl = h('div', 'pipatch-errors');
  protected readonly detailEl = h('div', 'pipatch-detail');
  protected readonly tooltip = h('div', 'pipatch-tooltip');

  private resizeObs: ResizeObserver | null = null;
  /** The width the view last drew at (`measure`): a resize that moves it by > 4 px draws again. */
  private drawnWidth = 0;
  private framePending = false;
  private destroyed = false;

  /** A view in `el` (added by `mount`), its root of class `pipatch-grid` and `kind`. */
  constructor(el: HTMLElement, callbacks: GridCallbacks, kind = '') {
    this.cb = callbacks;
    ensureStyle(el);
    this.root = h('div', kind ? `pipatch-grid ${kind}` : 'pipatch-grid');
    this.root.setAttribute('data-status', 'loading');
  }

  /**
   * Put the view in `el`: the header (title, subtitle, then `header`), the toolbar, status,
   * warnings and errors, the view's `body`, the detail pane and the (hidden) tooltip; from
   * now on a change of the root's width draws the view again.
   */
  protected mount(el: HTMLElement, body: Element[], header: Element[] = []): void {
    const head = h('div', 'pipatch-header');
    head.append(this.titleEl, this.subtitleEl, ...header);
    this.root.append(head, this.toolbar, this.statusEl, this.warningsEl, this.errorsEl, ...body, this.detailEl, this.tooltip);
    this.tooltip.style.display = 'none';
    el.appendChild(this.root);
    if (typeof ResizeObserver !== 'undefined') {
      this.resizeObs = new ResizeObserver(() => this.resized());
      this.resizeObs.observe(this.root);
    }
  }

  /** Stop observing and listening, and take the view out of the page. */
  destroy(): void {
    this.destroyed = true;
    this.resizeObs?.disconnect();
    this.resizeObs = null;
    this.listeners.abort();
    this.root.remove();
  }

  /** Draw `state` with the UI choices `ui` (merged into the view's): once, cheap enough to
   * call on every change of the state. */
  update(state: GridState, ui: Partial<UiState> = {}): void {
    this.state = state;
    this.ui = { ...this.ui, ...ui };
    if (!state.views.includes(this.ui.view)) this.ui.view = state.views[0] ?? '';
    this.accept(state);
    this.render();
  }

  /** Show decoding problems without breaking the rest of the view. */
  setErrors(errors: string[]): void {
    this.errorsEl.replaceChildren(...errors.map((e) => h('div', 'pipatch-error', e)));
  }

  /** What the view derives from a new state before drawing it (its edges, its UI choices). */
  protected accept(_state: GridState): void {}

  /** Draw the whole state (nothing before the first `update`). */
  protected abstract render(): void;

  /** The width the view draws in, in pixels: `rootWidth` less the view's margins. */
  protected abstract availWidth(): number;

  /** The root's width (its parent's before it has one; `fallback` before either has). */
  protected rootWidth(fallback: number): number {
    const w = this.root.clientWidth || (this.root.parentElement?.clientWidth ?? 0);
    return w > 0 ? w : fallback;
  }

  /** `availWidth`, remembered as the width drawn at. */
  protected measure(): number {
    this.drawnWidth = this.availWidth();
    return this.drawnWidth;
  }

  /** The resize observer's answer: draw again when the width to draw at moved by > 4 px. */
  protected resized(): void {
    if (this.state && !this.destroyed && Math.abs(this.availWidth() - this.drawnWidth) > 4) this.scheduleRender();
  }

  /** `render` once on the next frame, however often this is called before it. */
  protected scheduleRender(): void {
    if (this.framePending) return;
    this.framePending = true;
    const raf = typeof requestAnimationFrame === 'function' ? requestAnimationFrame : (f: () => void) => setTimeout(f, 16);
    raf(() => {
      this.framePending = false;
      if (!this.destroyed) this.render();
    });
  }

  /** `target.addEventListener(type, fn)` until the view is destroyed. */
  protected listen<K extends keyof HTMLElementEventMap>(target: EventTarget, type: K, fn: (ev: HTMLElementEventMap[K]) => void): void {
    target.addEventListener(type, fn as EventListener, { signal: this.signal });
  }

  /**
   * The frame every view draws the same way: the status (on the root and the status line,
   * whose text is `status`), the title, the subtitle (kind, model, metric, baselines) and the
   * warnings.
   */
  protected renderFrame(s: GridState, status: string): void {
    this.root.setAttribute('data-status', s.status);
    this.titleEl.textContent = s.title || 'pipatch';
    const base = Object.entries(s.baselines).map(([k, v]) => `${k} ${formatValue(v)}`).join(', ');
    this.subtitleEl.textContent = [s.kind, s.model_name, s.metric ? `metric: ${s.metric}` : '', base].filter(Boolean).join(' · ');
    this.statusEl.textContent = status;
    this.statusEl.setAttribute('data-status', s.status);
    const warnings = s.warnings.map((w) => h('li', 'pipatch-warning', `⚠ ${w}`));
    this.warningsEl.replaceChildren(...warnings);
    this.warningsEl.style.display = warnings.length ? '' : 'none';
  }

  /** The tooltip's text, a line each (`null`: hide it). */
  protected tip(lines: string[] | null): void {
    if (!lines) {
      this.tooltip.style.display = 'none';
      return;
    }
    this.tooltip.replaceChildren(...lines.map((l) => h('div', 'pipatch-tip-line', l)));
  }

  /** Show the tooltip beside the pointer of `ev`. */
  protected placeTip(ev: MouseEvent): void {
    showTooltip(this.tooltip, this.root, ev);
  }

  /** Save `blob` as `<stem>.<ext>`, its name made safe (the stem: the title). */
  protected save(blob: Blob, ext: string, stem = this.state?.title ?? ''): void {
    downloadBlob(this.root, blob, safeFileName(stem, ext));
  }
}
