/**
 * The DOM primitives every view draws with: elements (`h`, `svg`), the one stylesheet, the
 * tooltip's placement, canvas and colour helpers, saving a file. Stateless; the views
 * (grid.ts, circuit.ts, features.ts, on the lifecycle of view.ts) are made of them.
 *
 * Every string that comes from a tokenizer, a user or the kernel is set with
 * `textContent` / `setAttribute` / canvas `fillText`; no HTML is ever parsed.
 */

import { barColor, formatValue, tooltipPlace, type ScaleKind } from './format';
import { GRID_CSS } from './style';

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
