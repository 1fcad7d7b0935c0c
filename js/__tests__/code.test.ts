import { describe, expect, it } from 'vitest';
import { normalizeState } from '../data';
import { GridView } from '../grid';
import { f32spec } from './helpers';

const SCRIPT = 'PROMPT = \'<img src=x onerror=alert(1)>\'\nprint("""</pre><script>alert(1)</script>""")\n';

function state(code: string) {
  return normalizeState({
    title: 't',
    views: ['resid'],
    row_labels: ['0'],
    col_labels: ['a'],
    status: 'done',
    code,
    arrays: { 'resid/mean': f32spec([0.5], [1, 1]) },
  });
}

describe('Code panel', () => {
  it('shows the script as text in a <pre>, behind a Code button, with a Copy button', async () => {
    const el = document.createElement('div');
    document.body.appendChild(el);
    const g = new GridView(el, {});
    g.update(state(SCRIPT));
    const toggle = el.querySelector<HTMLButtonElement>('.pipatch-code-toggle')!;
    const panel = el.querySelector<HTMLDivElement>('.pipatch-code')!;
    expect(toggle.style.display).toBe('');
    expect(panel.style.display).toBe('none');
    toggle.click();
    expect(panel.style.display).toBe('');
    const pre = panel.querySelector('pre')!;
    expect(pre.textContent).toBe(SCRIPT);
    expect(pre.children.length).toBe(0); // text only: nothing parsed as HTML
    expect(el.querySelector('img')).toBeNull();
    expect(el.querySelector('script')).toBeNull();

    let copied = '';
    Object.defineProperty(navigator, 'clipboard', {
      value: { writeText: (t: string) => ((copied = t), Promise.resolve()) },
      configurable: true,
    });
    panel.querySelector<HTMLButtonElement>('.pipatch-code-copy')!.click();
    await Promise.resolve();
    expect(copied).toBe(SCRIPT);
    toggle.click();
    expect(panel.style.display).toBe('none');
    g.destroy();
  });

  it('has no Code button when the result has no script', () => {
    const el = document.createElement('div');
    const g = new GridView(el, {});
    g.update(state(''));
    expect(el.querySelector<HTMLButtonElement>('.pipatch-code-toggle')!.style.display).toBe('none');
    g.destroy();
  });
});
