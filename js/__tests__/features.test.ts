/**
 * A feature grid's rows are latents: the tooltip names a row by what it is (`row_axis`) and
 * shows its note (`row_notes`: a latent's label and top contexts) as text, one line each.
 */
import { describe, expect, it } from 'vitest';
import { normalizeState } from '../data';
import { GridView } from '../grid';
import { documentToState } from '../mime';
import { f32spec } from './helpers';

const HOSTILE_LABEL = '<img src=x onerror=window.__pwned=1>';

function features(extra: Record<string, unknown> = {}) {
  return normalizeState({
    views: ['L6 resid_post'],
    row_labels: ['L6 #12', 'L6 #3', 'L6 error'],
    col_labels: ['The', ' Eiffel'],
    row_axis: 'latent',
    row_notes: [
      'the Eiffel Tower\n… the «Eiffel» Tower  (4.2)\n\u202Eevil «x»  (1)',
      `${HOSTILE_LABEL}\n<script>window.__pwned=1</script>`,
      "the SAE's error: the part of the value it does not explain",
    ],
    status: 'done',
    arrays: { 'L6 resid_post/mean': f32spec([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [3, 2]) },
    ...extra,
  });
}

describe('feature rows in the tooltip', () => {
  it('names a latent row by its label and shows its note line by line', () => {
    const g = new GridView(document.createElement('div'), {});
    g.update(features(), { view: 'L6 resid_post', seed: -1, mode: 'recovery' });
    const info = g.cellInfo(0, 1);
    expect(info.slice(0, 4)).toEqual(['latent: L6 #12', 'the Eiffel Tower', '… the «Eiffel» Tower  (4.2)', '⟨U+202E⟩evil «x»  (1)']);
    expect(info[4]).toBe('token 1:  Eiffel');
    expect(info.join('\n')).toContain('recovery: 0.200');
    expect(g.cellInfo(2, 0)[1]).toContain("SAE's error");
  });
  it('keeps hostile label and context text as text in the drawn tooltip', () => {
    const el = document.createElement('div');
    document.body.appendChild(el);
    const g = new GridView(el, {});
    g.update(features(), { view: 'L6 resid_post', seed: -1, mode: 'recovery' });
    const info = g.cellInfo(1, 0);
    expect(info[1]).toBe(HOSTILE_LABEL);
    expect(info[2]).toBe('<script>window.__pwned=1</script>');
    const cellH = (g as unknown as { layout: { cellH: number } }).layout.cellH;
    el.querySelector('.pipatch-overlay')!.dispatchEvent(new MouseEvent('mousemove', { bubbles: true, clientX: 1, clientY: cellH + 1 }));
    const lines = Array.from(el.querySelectorAll('.pipatch-tooltip .pipatch-tip-line')).map((e) => e.textContent);
    expect(lines.slice(0, 3)).toEqual(['latent: L6 #3', HOSTILE_LABEL, '<script>window.__pwned=1</script>']);
    expect(el.querySelector('img')).toBeNull();
    expect(el.querySelector('script')).toBeNull();
    g.destroy();
  });
  it('cuts a very long note line', () => {
    const g = new GridView(document.createElement('div'), {});
    g.update(features({ row_notes: ['x'.repeat(5000)] }), { view: 'L6 resid_post', seed: -1, mode: 'recovery' });
    expect(g.cellInfo(0, 0)[1].length).toBeLessThanOrEqual(160);
    expect(g.cellInfo(1, 0)[1]).toMatch(/^token 0/); // a row without a note adds no line
  });
  it("shows a feature read's cell note: the latent at that rank and position, its label and contexts", () => {
    const read = normalizeState({
      views: ['L6 resid_post', 'L3 resid_post'],
      row_labels: ['top 1', 'top 2'],
      col_labels: ['The', ' Eiffel'],
      row_axis: 'rank',
      cell_notes: {
        'L6 resid_post': ['latent 12\nthe Eiffel Tower\n… the «Eiffel» Tower  (4.2)', `latent 3\n${HOSTILE_LABEL}`, 'latent 3', ''],
        'L3 resid_post': ['latent 8', '', '', ''],
      },
      status: 'done',
      arrays: { 'L6 resid_post/mean': f32spec([2, 1.5, 1, NaN], [2, 2]), 'L3 resid_post/mean': f32spec([1, NaN, NaN, NaN], [2, 2]) },
    });
    const el = document.createElement('div');
    document.body.appendChild(el);
    const g = new GridView(el, {});
    g.update(read, { view: 'L6 resid_post', seed: -1, mode: 'recovery' });
    expect(g.cellInfo(0, 0).slice(0, 4)).toEqual(['rank: top 1', 'latent 12', 'the Eiffel Tower', '… the «Eiffel» Tower  (4.2)']);
    expect(g.cellInfo(0, 0)[4]).toBe('token 0: The');
    expect(g.cellInfo(1, 0).slice(0, 3)).toEqual(['rank: top 2', 'latent 3', 'token 0: The']);
    expect(g.cellInfo(1, 1)[1]).toBe('token 1:  Eiffel'); // no latent fires there: no note
    expect(g.cellInfo(0, 0, false)).not.toContain('latent 12'); // the detail pane's head leaves notes out
    const cellW = (g as unknown as { layout: { cellW: number } }).layout.cellW;
    el.querySelector('.pipatch-overlay')!.dispatchEvent(
      new MouseEvent('mousemove', { bubbles: true, clientX: cellW + 1, clientY: 1 }),
    );
    const lines = Array.from(el.querySelectorAll('.pipatch-tooltip .pipatch-tip-line')).map((e) => e.textContent);
    expect(lines.slice(0, 3)).toEqual(['rank: top 1', 'latent 3', HOSTILE_LABEL]);
    expect(el.querySelector('img')).toBeNull();
    g.update(read, { view: 'L3 resid_post', seed: -1, mode: 'recovery' });
    expect(g.cellInfo(0, 0)[1]).toBe('latent 8'); // each view its own SAE's latents
    g.destroy();
  });
  it('reads an older document without the fields as layer rows without notes', () => {
    const { state, errors } = documentToState({ version: 1, row_labels: ['0', '1'], col_labels: ['a'] });
    expect(errors).toEqual([]);
    expect(state.row_axis).toBe('');
    expect(state.row_notes).toEqual([]);
    expect(state.cell_notes).toEqual({});
    const g = new GridView(document.createElement('div'), {});
    g.update(normalizeState({ row_labels: ['0'], col_labels: ['a'], views: ['resid'], arrays: { 'resid/mean': f32spec([1], [1, 1]) } }));
    expect(g.cellInfo(0, 0)[0]).toBe('layer: 0');
    expect(g.cellInfo(0, 0)[1]).toBe('token 0: a');
  });
});
