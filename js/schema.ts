/**
 * The one view state, as the browser reads it: the same schema as `pipatch/_results/views/schema.py`
 * (checked by `js/__tests__/parity.test.ts` against a state the kernel really makes).
 * `normalizeState` (data.ts) reads every state through `STATE_SCHEMA`, and the anywidget entry
 * listens to exactly its keys: a new field is one line here and one in the Python schema.
 *
 * Types: 'str', 'str[]', 'int', 'int[]', 'int?' (null for none), 'float', 'float[]', 'float?'
 * (null when not finite), 'float?[]', 'bool', '{str: int}', '{str: float?}', '{str: str[]}', 'arrays'
 * ({name: {data, dtype, shape}}), and the named objects 'detail', 'top[]', 'selection', 'ui',
 * 'circuit' ('node[]', 'check[]', 'faithfulness'), 'feature_graph' ('fnode[]', 'fedge[]', 'group[]'). Arrays are named `<view>/<what>`; `ARRAY_SCHEMA` gives
 * each `what` its shape in rows (row_labels), cols (col_labels) and seeds (n_seeds).
 */

/** The saved grid document's MIME type (the one constant on this side). */
export const MIME_TYPE = 'application/vnd.pipatch.grid+json';
/** The result schema version this front end reads (the document's `version`). */
export const SCHEMA_VERSION = 1;

/** Kernel → browser: the state of one grid (widget traits of the same names). */
export const STATE_SCHEMA = {
  title: 'str',
  kind: 'str',
  model_name: 'str',
  metric: 'str',
  row_labels: 'str[]',
  row_axis: 'str',
  row_notes: 'str[]',
  cell_notes: '{str: str[]}', // per view, each cell's hover text, row-major (a feature read's latents; {} none)
  col_labels: 'str[]',
  col_axis: 'str',
  views: 'str[]',
  n_seeds: 'int',
  seed_noun: 'str',
  seed_labels: 'str[]',
  arrays: 'arrays',
  rows_done: '{str: int}',
  row_order: '{str: int}',
  total_rows: 'int',
  status: 'str',
  message: 'str',
  warnings: 'str[]',
  elapsed: 'float',
  eta: 'float',
  baselines: '{str: float?}',
  detail: 'detail',
  stoppable: 'bool',
  live_id: 'str',
  code: 'str',
  sides: 'str[]',
  compared: 'str',
  values: 'str',
  circuit: 'circuit',
  subject: 'int[]',
  feature_graph: 'feature_graph', // a feature circuit's graph ({} for any other result): drawn as a graph
} as const;

/** The kernel's answer to a click; every field optional. */
export const DETAIL_SCHEMA = {
  view: 'str',
  seed: 'int',
  row: 'int',
  col: 'int',
  value: 'float?',
  raw: 'float?',
  top: 'top[]',
  error: 'str',
  exact: 'float?', // a circuit: the clicked edge's exact change over exact_pairs pairs
  exact_pairs: 'int',
} as const;
export const TOP_SCHEMA = { token: 'str', prob: 'float?' } as const;

/**
 * A circuit's graph (`{}` for any other result); its edges' scores are the arrays
 * `edges/raw_mean` less the corrupt baseline. Every field optional.
 */
export const CIRCUIT_SCHEMA = {
  nodes: 'node[]',
  senders: 'int[]',
  receivers: 'int[]',
  ports: 'float[]',
  checked: 'check[]',
  agreement: '{str: float?}',
  faithfulness: 'faithfulness',
} as const;
/** `x` in [0, 1] across its row, `y` its row (0: the embeddings). */
export const NODE_SCHEMA = { name: 'str', kind: 'str', layer: 'int', x: 'float', y: 'float' } as const;
export const CHECK_SCHEMA = { row: 'int', col: 'int', estimate: 'float?', exact: 'float?' } as const;
export const FAITHFULNESS_SCHEMA = {
  sizes: 'int[]',
  recovery: 'float?[]',
  share: 'float?',
  size: 'int?',
  edges: 'int',
} as const;

/**
 * A feature circuit's graph: rows are its SAEs (`sites`, bottom up; the metric's node one row
 * above), columns its positions; the nodes drawn, the edges kept and the user's groups
 * (supernodes). Every field optional (`{}`: not a feature circuit).
 */
export const FEATURE_GRAPH_SCHEMA = {
  sites: 'str[]',
  positions: 'int[]',
  nodes: 'fnode[]',
  edges: 'fedge[]',
  groups: 'group[]',
  total: 'int', // how many nodes the graph has in all (more than drawn when it is large)
} as const;
/** `row` its SAE (`sites.length`: the metric), `latent` NaN for an error or the metric (`kind`
 * says which), `exact` NaN where not checked, `note` its label and top contexts. */
export const FNODE_SCHEMA = {
  name: 'str',
  row: 'int',
  position: 'int',
  latent: 'int?',
  kind: 'str',
  score: 'float?',
  exact: 'float?',
  circuit: 'bool',
  note: 'str',
} as const;
/** An edge between nodes `up` and `down` (indices into `nodes`); `exact` NaN where not checked. */
export const FEDGE_SCHEMA = { up: 'int', down: 'int', score: 'float?', exact: 'float?' } as const;
/** A supernode: a name for a group of nodes (by name). */
export const GROUP_SCHEMA = { name: 'str', nodes: 'str[]' } as const;

/** Browser → kernel: what the user chose (widget traits of the same names). */
export const UI_SCHEMA = {
  view: 'str',
  seed: 'int',
  mode: 'str',
  selected: 'selection',
  stop_requested: 'bool',
} as const;
export const SELECTION_SCHEMA = { view: 'str', seed: 'int', row: 'int', col: 'int' } as const;

/** The saved document is the state (less `detail`) plus these. */
export const DOCUMENT_SCHEMA = { version: 'int', ui: 'ui' } as const;

export const ARRAY_DTYPE = 'float32';
export const ARRAY_SCHEMA = {
  mean: ['rows', 'cols'],
  raw_mean: ['rows', 'cols'],
  std: ['rows', 'cols'],
  seeds: ['seeds', 'rows', 'cols'],
  raw_seeds: ['seeds', 'rows', 'cols'],
  verified: ['rows', 'cols'],
  a: ['rows', 'cols'],
  b: ['rows', 'cols'],
} as const;

export type StateKey = keyof typeof STATE_SCHEMA;
export const STATE_KEYS = Object.keys(STATE_SCHEMA) as StateKey[];
