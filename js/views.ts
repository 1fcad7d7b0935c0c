/**
 * Which view draws a state: the one place that knows every view (widget.ts and mime.ts ask
 * it). A feature circuit's state (`feature_graph` nodes) is drawn by `FeatureView`, a
 * circuit's (`circuit` nodes) by `CircuitView`, every other by `GridView`. The views know
 * nothing of each other: each stands on the one view base (view.ts).
 */

import type { GridState } from './data';
import { CircuitView, isCircuit } from './circuit';
import { FeatureView, isFeatureGraph } from './features';
import { GridView } from './grid';
import type { GridCallbacks, StateView } from './view';

export type { GridCallbacks, StateView };

/** The view for `state` in `el`: `current` when it is the right kind, else a new one (a feature
 * circuit's graph, a circuit's graph or the grid) in its place. */
export function viewFor(current: StateView | null, state: GridState, el: HTMLElement, callbacks: GridCallbacks): StateView {
  const wanted = isFeatureGraph(state) ? FeatureView : isCircuit(state) ? CircuitView : GridView;
  if (current instanceof wanted) return current;
  current?.destroy();
  return new wanted(el, callbacks);
}
