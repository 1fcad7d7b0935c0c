import { describe, expect, it } from 'vitest';
import { decodeArray, gridShape, normalizeState, selectMatrix, toBytes } from '../data';
import { f32bytes, f32spec, toBase64 } from './helpers';

describe('decodeArray', () => {
  const vals = [0.5, -1, NaN, 3];
  it('decodes DataView, ArrayBuffer, Uint8Array and base64 to the same Float32Array', () => {
    const bytes = f32bytes(vals);
    const forms = [
      new DataView(bytes.buffer),
      bytes.buffer,
      bytes,
      toBase64(bytes),
    ];
    for (const data of forms) {
      const a = decodeArray({ data, dtype: 'float32', shape: [2, 2] });
      expect(a.shape).toEqual([2, 2]);
      expect(Array.from(a.data.subarray(0, 2))).toEqual([0.5, -1]);
      expect(Number.isNaN(a.data[2])).toBe(true);
      expect(a.data[3]).toBe(3);
    }
  });
  it('handles unaligned views by copying', () => {
    const buf = new Uint8Array(17);
    buf.set(f32bytes([1.5, 2.5, 3.5, 4.5]), 1);
    const a = decodeArray({ data: new DataView(buf.buffer, 1, 16), dtype: 'float32', shape: [4] });
    expect(Array.from(a.data)).toEqual([1.5, 2.5, 3.5, 4.5]);
  });
  it('decodes float64 and float16', () => {
    const f64 = new Uint8Array(new Float64Array([1.25, -2]).buffer);
    expect(Array.from(decodeArray({ data: f64, dtype: 'float64', shape: [2] }).data)).toEqual([1.25, -2]);
    const f16 = new Uint8Array(new Uint16Array([0x3c00, 0xc000]).buffer); // 1, -2
    expect(Array.from(decodeArray({ data: f16, dtype: 'float16', shape: [2] }).data)).toEqual([1, -2]);
  });
  it('rejects a shape that does not match the data', () => {
    expect(() => decodeArray({ data: f32bytes([1, 2, 3]), dtype: 'float32', shape: [2, 2] })).toThrow(/shape/);
    expect(() => decodeArray({ data: f32bytes([1]), dtype: 'complex64', shape: [1] })).toThrow(/dtype/);
  });
  it('accepts base64 with url-safe alphabet and whitespace', () => {
    const b64 = toBase64(f32bytes([1, 2])).replace(/\+/g, '-').replace(/\//g, '_');
    expect(Array.from(decodeArray({ data: ` ${b64}\n`, dtype: 'float32', shape: [2] }).data)).toEqual([1, 2]);
  });
  it('toBytes accepts nested {buffer}', () => {
    expect(toBytes({ buffer: new ArrayBuffer(8) }).byteLength).toBe(8);
  });
});

describe('normalizeState and selection', () => {
  const state = normalizeState({
    views: ['resid', 'mlp'],
    n_seeds: 2,
    row_labels: ['0', '1'],
    col_labels: ['a', 'b', 'c'],
    arrays: {
      'resid/mean': f32spec([1, 2, 3, 4, 5, 6], [2, 3]),
      'resid/raw_mean': f32spec([6, 5, 4, 3, 2, 1], [2, 3]),
      'resid/seeds': f32spec([0, 0, 0, 0, 0, 0, 7, 7, 7, 7, 7, 7], [2, 2, 3]),
      'bad/mean': f32spec([1, 2, 3], [2, 2]),
    },
  });
  it('keeps good arrays and reports bad ones', () => {
    const errors: string[] = [];
    const s = normalizeState({ arrays: { 'x/mean': { data: 'AAAA', dtype: 'float32', shape: [5] } } }, errors);
    expect(Object.keys(s.arrays)).toEqual([]);
    expect(errors[0]).toMatch(/x\/mean/);
  });
  it('selects mean, seed and raw matrices', () => {
    expect(gridShape(state, 'resid')).toEqual({ rows: 2, cols: 3 });
    expect(Array.from(selectMatrix(state, 'resid', -1, 'recovery').data!)).toEqual([1, 2, 3, 4, 5, 6]);
    expect(Array.from(selectMatrix(state, 'resid', 1, 'recovery').data!)).toEqual([7, 7, 7, 7, 7, 7]);
    expect(Array.from(selectMatrix(state, 'resid', -1, 'raw').data!)).toEqual([6, 5, 4, 3, 2, 1]);
    expect(selectMatrix(state, 'mlp', -1, 'recovery').data).toBeNull();
  });
  it('defaults sensibly', () => {
    const s = normalizeState({});
    expect(s.status).toBe('done');
    expect(s.eta).toBe(-1);
    expect(s.views).toEqual([]);
    expect(s.stoppable).toBe(false);
  });
});

describe('normalizeState through the schema', () => {
  it('keeps only schema keys, each in its type, with defaults', () => {
    const s = normalizeState({ title: 3, bogus: 'x', n_seeds: '2', baselines: { clean: null, corrupt: 0.5 }, stoppable: 'yes' });
    expect(s.title).toBe('3');
    expect('bogus' in s).toBe(false);
    expect(s.n_seeds).toBe(2);
    expect(Number.isNaN(s.baselines.clean)).toBe(true);
    expect(s.baselines.corrupt).toBe(0.5);
    expect(s.stoppable).toBe(false);
    expect(s.status).toBe('done');
    expect(s.col_axis).toBe('token');
    expect(s.eta).toBe(-1);
  });
  it('reports arrays whose shape disagrees with the labels', () => {
    const errors: string[] = [];
    normalizeState(
      { row_labels: ['0', '1'], col_labels: ['a', 'b', 'c'], n_seeds: 1, arrays: { 'resid/mean': f32spec([1, 2, 3, 4, 5, 6], [3, 2]) } },
      errors,
    );
    expect(errors).toEqual(['array resid/mean: shape [3, 2], labels say [2, 3]']);
  });
});
