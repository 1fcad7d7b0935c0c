/** Test helpers: float32 array specs in the forms the kernel / a saved document produce. */
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
