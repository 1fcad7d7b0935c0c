/**
 * JupyterLab MIME renderer for `application/vnd.pipatch.grid+json`: draws a saved PatchGrid
 * with the same GridView as the live widget (a circuit with the same CircuitView), no kernel
 * needed. View / seed / mode switching,
 * hover, PNG and CSV work locally; top-5 predictions need the live widget.
 *
 * A document with a `live_id` is the saved copy of a live grid shown just above it: it hides
 * while that grid is live on the page, and otherwise says in one line how to get a clickable
 * grid back (see `liveness.ts`).
 */
import type { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import type { ReadonlyPartialJSONObject } from '@lumino/coreutils';
import { Widget } from '@lumino/widgets';
import { normalizeState, type Group, type UiState } from './data';
import { withGroup } from './features';
import { GridView } from './grid';
import { hideDeadWidgetBefore, isLive, markCopy, onGroups, onLiveChange, setShown } from './liveness';
import { MIME_TYPE, SCHEMA_VERSION } from './schema';
import { viewFor, type StateView } from './views';

export { MIME_TYPE };

/** Parse the document (object, or a JSON string from some pipelines) into a state. */
export function documentToState(doc: unknown) {
  let d = doc;
  if (typeof d === 'string') d = JSON.parse(d);
  if (!d || typeof d !== 'object') throw new Error('pipatch grid document is not an object');
  const raw = d as Record<string, unknown>;
  const errors: string[] = [];
  const version = Number(raw.version ?? 1);
  if (version > SCHEMA_VERSION) {
    errors.push(`document version ${version} is newer than this renderer (${SCHEMA_VERSION}); showing what it can`);
  }
  const state = normalizeState(raw, errors);
  // A saved document is final: a 'running' status means the kernel died before the last update.
  if (state.status === 'running') {
    state.status = 'interrupted';
    if (!state.message) state.message = 'saved while running';
  }
  state.stoppable = false;
  return { state, errors, ui: raw.ui as Partial<UiState> | undefined };
}

/** The saved copy's one line: how to get the interactive grid back. */
export const SAVED_COPY_HINT =
  'Saved copy: clicks (top-5) need the live grid. Run the cell again, or show PatchGrid(result) for a result computed in this kernel.';

export class GridRenderer extends Widget implements IRenderMime.IRenderer {
  private grid: StateView | null = null;
  private ui: Partial<UiState> = {};
  private liveId = '';
  private hint: HTMLElement | null = null;
  private unwatch: (() => void)[] = [];
  private watchingDead = false;
  private model: IRenderMime.IMimeModel | null = null;

  constructor(private options: IRenderMime.IRendererOptions) {
    super();
    this.addClass('pipatch-mime');
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    const data = model.data[this.options.mimeType];
    const callbacks = {
      live: false,
      onUiChange: (p: Partial<UiState>) => {
        this.ui = { ...this.ui, ...p };
      },
      onGroup: (name: string, nodes: string[]) => {
        const groups = (this.document(model).feature_graph as { groups?: Group[] } | undefined)?.groups ?? [];
        this.keepGroups(model, withGroup(groups, name, nodes));
      },
    };
    this.model = model;
    try {
      const { state, errors, ui } = documentToState(data);
      if (ui && Object.keys(this.ui).length === 0) this.ui = { ...ui };
      this.grid = viewFor(this.grid, state, this.node, callbacks);
      this.grid.setErrors(errors);
      this.grid.update(state, this.ui);
      this.pairWithLiveGrid(state.live_id);
    } catch (e) {
      this.grid ??= new GridView(this.node, callbacks);
      this.grid.setErrors([`cannot draw pipatch grid: ${(e as Error).message}`]);
    }
  }

  /** The document as an object (some pipelines store it as a JSON string). */
  private document(model: IRenderMime.IMimeModel): Record<string, unknown> {
    const data = model.data[this.options.mimeType];
    const doc = typeof data === 'string' ? JSON.parse(data) : data;
    return doc && typeof doc === 'object' ? (doc as Record<string, unknown>) : {};
  }

  /** Keep a feature circuit's supernodes in the document: the notebook saves them. */
  private keepGroups(model: IRenderMime.IMimeModel, groups: Group[]): void {
    const doc = this.document(model);
    const graph = (doc.feature_graph ?? {}) as Record<string, unknown>;
    if (JSON.stringify(graph.groups ?? []) === JSON.stringify(groups)) return;
    const next = { ...doc, feature_graph: { ...graph, groups } };
    model.setData({ data: { ...model.data, [this.options.mimeType]: next as unknown as ReadonlyPartialJSONObject } });
  }

  /** Hide while the live grid `id` is on the page; otherwise show, with the hint line. */
  private pairWithLiveGrid(id: string): void {
    if (!id || id === this.liveId) return;
    if (this.liveId) markCopy(this.liveId, false);
    this.liveId = id;
    markCopy(id, true);
    // The live grid's supernodes: kept in this copy, so they survive the kernel.
    this.unwatch.push(onGroups(id, (groups) => this.model && this.keepGroups(this.model, groups)));
    if (!this.hint) {
      this.hint = document.createElement('div');
      this.hint.className = 'pipatch-saved-hint';
      this.hint.textContent = SAVED_COPY_HINT;
      this.node.prepend(this.hint);
    }
    this.unwatch.push(onLiveChange(id, () => this.syncShown()));
    if (this.isAttached) this.onAfterAttach();
  }

  private syncShown(): void {
    if (this.liveId) setShown(this.node, !isLive(this.liveId));
  }

  /** In the output area now (JupyterLab attaches a renderer after `renderModel` starts). */
  protected onAfterAttach(): void {
    if (!this.liveId) return;
    this.syncShown();
    if (!this.watchingDead) {
      this.watchingDead = true;
      this.unwatch.push(hideDeadWidgetBefore(this.node));
    }
  }

  dispose(): void {
    for (const stop of this.unwatch.splice(0)) stop();
    if (this.liveId) markCopy(this.liveId, false);
    this.grid?.destroy();
    this.grid = null;
    super.dispose();
  }
}

export const rendererFactory: IRenderMime.IRendererFactory = {
  safe: true,
  mimeTypes: [MIME_TYPE],
  defaultRank: 0,
  createRenderer: (options) => new GridRenderer(options),
};

const extension: IRenderMime.IExtension = {
  id: 'pipatch:grid',
  rendererFactory,
  // Below image/png (90) so a bundle that carries both shows the interactive grid;
  // above the widget view (-10) which the live session uses while the kernel runs.
  rank: 0,
  dataType: 'json',
};

export default extension;
