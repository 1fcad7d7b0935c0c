/** Test helpers: float32 array specs in the forms the kernel / a saved document produce, and
 * the states of a circuit and a feature circuit as the kernel makes them. */
import { normalizeState, type GridState } from '../data';

export function f32bytes(values: number[]): Uint8Array {
  return new Uint8Array(new Float32Array(values).buffer);
}

export function f32spec(values: number[], shape: number[]) {
  return { data: new DataView(f32bytes(values).buffer), dtype: 'float32', shape };
}

export function toBase64(bytes: Uint8Array): string {
  let s = '';
  for (const b of bytes) s += String.fromCharCode(b);
  return btoa(s);
}

/**
 * A circuit's state as the kernel makes it (pipatch/_results/views/circuit.py): `layers` layers of
 * `heads` heads, each head's q/k/v a receiver, each MLP a receiver and a sender, the logits.
 * Scores: edge i (row-major) is `score(i)`, NaN where a receiver reads nothing of the sender.
 */
export function circuitState(layers = 2, heads = 2, score = (i: number) => ((i * 37) % 23) / 23 - 0.5, extra: Record<string, unknown> = {}): GridState {
  const nodes: { name: string; kind: string; layer: number; x: number; y: number }[] = [{ name: 'emb', kind: 'emb', layer: -1, x: 0.5, y: 0 }];
  const senders = ['emb'];
  const senderLayer = [-1];
  const receivers: string[] = [];
  const receiverNode: number[] = [];
  const receiverLayer: number[] = [];
  const ports: number[] = [];
  const senderNode = [0];
  for (let l = 0; l < layers; l++) {
    for (let hd = 0; hd < heads; hd++) {
      nodes.push({ name: `${l}.${hd}`, kind: 'head', layer: l, x: (hd + 0.5) / (heads + 1), y: l + 1 });
      senders.push(`${l}.${hd}`);
      senderLayer.push(l);
      senderNode.push(nodes.length - 1);
      ['q', 'k', 'v'].forEach((w, k) => {
        receivers.push(`${l}.${hd}.${w}`);
        receiverNode.push(nodes.length - 1);
        receiverLayer.push(l);
        ports.push((k / 2 - 0.5) * 0.5 / (heads + 1));
      });
    }
    nodes.push({ name: `mlp${l}`, kind: 'mlp', layer: l, x: (heads + 0.5) / (heads + 1), y: l + 1.4 });
    senders.push(`mlp${l}`);
    senderLayer.push(l + 0.5);
    senderNode.push(nodes.length - 1);
    receivers.push(`mlp${l}`);
    receiverNode.push(nodes.length - 1);
    receiverLayer.push(l + 0.75);
    ports.push(0);
  }
  nodes.push({ name: 'logits', kind: 'logits', layer: layers, x: 0.5, y: layers + 1 });
  receivers.push('logits');
  receiverNode.push(nodes.length - 1);
  receiverLayer.push(layers + 1);
  ports.push(0);
  const R = receivers.length;
  const S = senders.length;
  const corrupt = 0.25;
  const raw: number[] = [];
  const rec: number[] = [];
  for (let r = 0; r < R; r++) {
    for (let s = 0; s < S; s++) {
      const ok = senderLayer[s] < receiverLayer[r] && !(Number.isInteger(receiverLayer[r]) && senderLayer[s] === receiverLayer[r]);
      const v = ok ? score(r * S + s) : NaN;
      raw.push(corrupt + v);
      rec.push(v / 2);
    }
  }
  return normalizeState({
    title: 'Circuit <b>x</b>',
    kind: 'circuit',
    metric: 'logit_diff',
    views: ['edges'],
    row_labels: receivers,
    col_labels: senders,
    col_axis: 'sender',
    baselines: { clean: 2.25, corrupt },
    status: 'done',
    arrays: { 'edges/mean': f32spec(rec, [R, S]), 'edges/raw_mean': f32spec(raw, [R, S]) },
    circuit: {
      nodes,
      senders: senderNode,
      receivers: receiverNode,
      ports,
      checked: [{ row: R - 1, col: 0, estimate: 0.1, exact: 0.09 }],
      agreement: { spearman: 0.9, n: 1 },
      ...extra,
    },
  });
}

export const HOSTILE = '<img src=x onerror="window.__pwned=1">';

/** A feature circuit's state as `FeatureCircuitResult.to_state` makes it: two SAEs, the metric. */
export function featureState(extra: Record<string, unknown> = {}): GridState {
  const nodes = [
    { name: 'metric', row: 2, position: 2, latent: null, kind: 'metric', score: 0.5, exact: 0.5, circuit: true, note: '' },
    { name: 'L0 #7 @1', row: 0, position: 1, latent: 7, kind: 'latent', score: 0.3, exact: 0.25, circuit: true, note: `${HOSTILE}\nthe <b>Eiffel</b>  (2.5)` },
    { name: 'L0 error @1', row: 0, position: 1, latent: null, kind: 'error', score: -0.2, exact: null, circuit: true, note: '' },
    { name: 'L1 #3 @2', row: 1, position: 2, latent: 3, kind: 'latent', score: 0.1, exact: null, circuit: true, note: '' },
    { name: 'L1 #9 @0', row: 1, position: 0, latent: 9, kind: 'latent', score: 0.01, exact: null, circuit: false, note: '' },
  ];
  return normalizeState({
    title: 'Feature circuit', kind: 'feature_circuit', metric: 'logit_diff', col_labels: ['The', ' Eiffel', ' Tower'],
    row_labels: ['L0', 'L1'], status: 'done',
    feature_graph: {
      sites: ['L0', 'L1'], positions: [0, 1, 2], nodes, total: 5,
      edges: [{ up: 1, down: 3, score: 0.05, exact: 0.04 }, { up: 2, down: 3, score: -0.01, exact: null }, { up: 4, down: 3, score: 0.001 }],
      groups: [], ...extra,
    },
  });
}
