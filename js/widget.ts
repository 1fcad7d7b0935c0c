/**
 * anywidget entry for pipatch.PatchGrid: adapts the model's traits to GridView (a circuit's
 * state to CircuitView: `viewFor`).
 *
 * Kernel → JS traits are read on every change (coalesced into one redraw per frame, since
 * `hold_sync()` delivers many `change:<trait>` events at once); UI choices are written back
 * with `model.set(...)` + `model.save_changes()`.
 */
import { normalizeState, type UiState } from './data';
import { viewFor, type GridCallbacks, type StateView } from './views';
import { hasCopy, markLive, publishGroups, setShown } from './liveness';

/** How long a view waits for its kernel before deferring to its saved copy (ms). */
const KERNEL_WAIT_MS = 4000;
const PING_EVERY_MS = 500;
import { STATE_KEYS, UI_SCHEMA } from './schema';

export { STATE_KEYS };

// Browser → kernel traits: a change made by another view of the same widget redraws this one.
const UI_KEYS = (Object.keys(UI_SCHEMA) as (keyof typeof UI_SCHEMA)[]).filter((k) => k !== 'stop_requested');

interface AnyModel {
  get(name: string): unknown;
  set(name: string, value: unknown): void;
  save_changes(): void;
  on(event: string, cb: (...args: unknown[]) => void): void;
  off(event?: string | null, cb?: ((...args: unknown[]) => void) | null): void;
  send(content: unknown): void;
}

function readUi(model: AnyModel): Partial<UiState> {
  const ui: Partial<UiState> = {};
  const v = model.get('view');
  if (typeof v === 'string') ui.view = v;
  const s = model.get('seed');
  if (typeof s === 'number') ui.seed = s;
  const m = model.get('mode');
  if (m === 'raw' || m === 'recovery') ui.mode = m;
  const sel = model.get('selected');
  ui.selected = sel && typeof sel === 'object' ? (sel as UiState['selected']) : {};
  return ui;
}

function render({ model, el }: { model: AnyModel; el: HTMLElement }): () => void {
  const callbacks: GridCallbacks = {
    live: true,
    onUiChange(partial) {
      for (const [k, v] of Object.entries(partial)) model.set(k, v);
      model.save_changes();
    },
    onStop() {
      model.set('stop_requested', true);
      model.save_changes();
    },
    onAblate(node) {
      model.send({ type: 'ablate', node });
    },
    onGroup(name, nodes) {
      model.send({ type: 'group', name, nodes });
    },
  };
  let grid: StateView | null = null;
  // Names this widget's saved copy (see liveness.ts).
  const liveId = String(model.get('live_id') ?? '');
  let groupsSent = '';

  let queued = false;
  const redraw = () => {
    queued = false;
    const raw: Record<string, unknown> = {};
    for (const k of STATE_KEYS) raw[k] = model.get(k);
    const errors: string[] = [];
    const state = normalizeState(raw, errors);
    grid = viewFor(grid, state, el, callbacks);
    grid.setErrors(errors);
    grid.update(state, readUi(model));
    // A feature circuit's supernodes: its saved copy on the page keeps them in the notebook.
    const groups = state.feature_graph?.groups;
    const text = JSON.stringify(groups ?? null);
    if (groups && text !== groupsSent) {
      groupsSent = text;
      publishGroups(liveId, groups);
    }
  };
  const schedule = () => {
    if (queued) return;
    queued = true;
    queueMicrotask(redraw);
  };
  const events = [...STATE_KEYS, ...UI_KEYS].map((k) => `change:${k}`);
  for (const ev of events) model.on(ev, schedule);
  redraw();

  // Live once the kernel answers: then the saved copy below (same live_id) hides. A view
  // restored from saved widget state, with no kernel behind it, never hears back and leaves
  // the copy showing (see liveness.ts).
  let live = false;
  const onMsg = (content: unknown) => {
    if (!live && (content as { type?: string } | null)?.type === 'pong') {
      live = true;
      setShown(el, true); // in case the deadline hid it before a late answer
      markLive(liveId, true);
    }
  };
  model.on('msg:custom', onMsg);
  // Ping until answered: a kernel busy with the cell reads the first message of a new comm
  // on its main channel only when the cell ends; later ones reach it on a subshell at once.
  const ping = () => {
    try {
      model.send({ type: 'ping' });
    } catch {
      // no comm (state restored without a kernel): the deadline below decides
    }
  };
  ping();
  const pinger = setInterval(() => (live ? clearInterval(pinger) : ping()), PING_EVERY_MS);
  const deadline = setTimeout(() => {
    clearInterval(pinger);
    if (!live && hasCopy(liveId)) setShown(el, false);
  }, KERNEL_WAIT_MS);
  return () => {
    clearInterval(pinger);
    clearTimeout(deadline);
    for (const ev of events) model.off(ev, schedule);
    model.off('msg:custom', onMsg);
    if (live) markLive(liveId, false);
    grid?.destroy();
  };
}

export default { render };
