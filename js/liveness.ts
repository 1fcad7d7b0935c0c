/**
 * A live grid and its saved copy, in the same page: which one shows.
 *
 * When a run ends, the kernel keeps the live widget and displays its saved copy (the
 * `application/vnd.pipatch.grid+json` bundle) as the next output; both carry the widget's
 * model id as `live_id`. The widget view and the MIME renderer are two bundles (anywidget
 * loads the first from the kernel, JupyterLab the second from the lab extension), so they meet
 * here, through the page: a registry on `window` and a `pipatch:live` event on `document`.
 *
 * - A widget view that has heard back from its kernel calls `markLive(id, true)`, and
 *   `markLive(id, false)` when it is destroyed (widget closed, kernel gone).
 * - A saved copy hides its output while its id is live (`isLive`, `onLiveChange`), so a live
 *   session shows one grid; once the live view is gone the copy shows.
 * - A reopened notebook's dead widget output ("Error displaying widget: model not found")
 *   is hidden by the copy that stands in for it (`hideDeadWidgetBefore`); a widget view
 *   restored from saved widget state, with no kernel to answer it, hides itself when its copy
 *   is on the page (`hasCopy`).
 *
 * Only display is toggled (`style.display`); nothing is removed, so a notebook saved from the
 * page still holds both outputs.
 */

import type { Group } from './data';

const REGISTRY = '__pipatchLive';
const COPIES = '__pipatchCopies';
const EVENT = 'pipatch:live';
const DEAD_WIDGET = /^\s*Error displaying widget/;

function registry(name = REGISTRY): Map<string, number> {
  const w = window as unknown as Record<string, Map<string, number> | undefined>;
  let reg = w[name];
  if (!reg) {
    reg = new Map();
    w[name] = reg;
  }
  return reg;
}

function count(name: string, id: string, delta: number): void {
  const reg = registry(name);
  const n = Math.max(0, (reg.get(id) ?? 0) + delta);
  if (n) reg.set(id, n);
  else reg.delete(id);
}

/** Count one saved copy of `id` on the page in (`true`) or out (`false`). */
export function markCopy(id: string, present: boolean): void {
  if (id) count(COPIES, id, present ? 1 : -1);
}

/** Whether a saved copy of `id` is on the page. */
export function hasCopy(id: string): boolean {
  return !!id && (registry(COPIES).get(id) ?? 0) > 0;
}

/** Count one live view of `id` in (`true`) or out (`false`), and tell the page. */
export function markLive(id: string, live: boolean): void {
  if (!id) return;
  count(REGISTRY, id, live ? 1 : -1);
  document.dispatchEvent(new CustomEvent(EVENT, { detail: { id } }));
}

/** Whether a view of `id` connected to its kernel is on the page. */
export function isLive(id: string): boolean {
  return !!id && (registry().get(id) ?? 0) > 0;
}

/** Call `callback()` whenever the liveness of `id` may have changed; returns an unsubscribe. */
export function onLiveChange(id: string, callback: () => void): () => void {
  const listener = (e: Event) => {
    if ((e as CustomEvent<{ id: string }>).detail?.id === id) callback();
  };
  document.addEventListener(EVENT, listener);
  return () => document.removeEventListener(EVENT, listener);
}

/** The notebook output holding `node` (the whole output row, prompt included), else `node`. */
export function outputOf(node: HTMLElement): HTMLElement {
  return (node.closest('.jp-OutputArea-child') as HTMLElement | null) ?? node;
}

/** Show or hide the output holding `node`. */
export function setShown(node: HTMLElement, shown: boolean): void {
  outputOf(node).style.display = shown ? '' : 'none';
}

/** A stream output (stdout or stderr: a warning, a "stopped" line) between a widget and its copy. */
const STREAM = '[data-mime-type="application/vnd.jupyter.stderr"], [data-mime-type="application/vnd.jupyter.stdout"]';

/**
 * Hide the live grid's output above `node`'s output (the grid whose saved copy `node` is) while
 * it says "Error displaying widget": dead since the notebook was reopened. Lines the run wrote
 * between the two (a warning, say) are stepped over. The widget renderer writes that text only
 * once the kernel has connected and the model is not there, so the output is watched. Returns
 * a function that stops watching.
 */
export function hideDeadWidgetBefore(node: HTMLElement): () => void {
  const own = outputOf(node);
  let target = own === node ? null : (own.previousElementSibling as HTMLElement | null);
  while (target && target.querySelector(STREAM)) target = target.previousElementSibling as HTMLElement | null;
  if (!target) return () => undefined;
  const dead = target;
  const check = () => {
    if (!dead.querySelector('.pipatch-grid') && DEAD_WIDGET.test(dead.textContent ?? '')) {
      dead.style.display = 'none';
    }
  };
  check();
  const obs = new MutationObserver(check);
  obs.observe(dead, { childList: true, subtree: true, characterData: true });
  return () => obs.disconnect();
}

const GROUPS_EVENT = 'pipatch:groups';

/** A live grid's supernodes (a feature circuit's groups), told to its saved copy on the page
 * (same id), which keeps them in the notebook's document so they survive the kernel. */
export function publishGroups(id: string, groups: Group[]): void {
  if (id) document.dispatchEvent(new CustomEvent(GROUPS_EVENT, { detail: { id, groups } }));
}

/** Call `callback(groups)` when the live grid `id` publishes its supernodes; returns an unsubscribe. */
export function onGroups(id: string, callback: (groups: Group[]) => void): () => void {
  const listener = (e: Event) => {
    const detail = (e as CustomEvent<{ id: string; groups: Group[] }>).detail;
    if (detail?.id === id) callback(detail.groups);
  };
  document.addEventListener(GROUPS_EVENT, listener);
  return () => document.removeEventListener(GROUPS_EVENT, listener);
}
