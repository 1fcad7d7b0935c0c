/**
 * A saved copy and its live grid on one page: the copy hides while the grid is live, shows
 * with its one-line hint once it is not, and hides the dead widget's "model not found" line.
 * The renderer is the real one (`GridRenderer`, attached with Lumino as JupyterLab does) in an
 * output-area layout with JupyterLab's class names.
 */
import { Widget } from '@lumino/widgets';
import { afterEach, describe, expect, it } from 'vitest';
import { hasCopy, isLive, markLive } from '../liveness';
import { GridRenderer, MIME_TYPE, SAVED_COPY_HINT } from '../mime';
import { f32bytes, toBase64 } from './helpers';

function doc(liveId: string) {
  return {
    version: 1,
    title: 'trace',
    kind: 'trace',
    status: 'done',
    row_labels: ['0', '1'],
    col_labels: ['a', 'b'],
    views: ['resid'],
    live_id: liveId,
    arrays: { 'resid/mean': { data: toBase64(f32bytes([0, 0.5, 1, 0.25])), dtype: 'float32', shape: [2, 2] } },
  };
}

/** An output area: a dead widget output, then the output the renderer is attached to. */
function outputArea() {
  const area = document.createElement('div');
  area.className = 'jp-OutputArea';
  const widgetOut = document.createElement('div');
  widgetOut.className = 'jp-OutputArea-child';
  const widgetNode = document.createElement('div'); // empty until the widget manager decides
  widgetOut.append(widgetNode);
  const copyOut = document.createElement('div');
  copyOut.className = 'jp-OutputArea-child';
  area.append(widgetOut, copyOut);
  document.body.append(area);
  return { area, widgetOut, widgetNode, copyOut };
}

async function renderCopy(host: HTMLElement, liveId: string): Promise<GridRenderer> {
  const renderer = new GridRenderer({ mimeType: MIME_TYPE } as never);
  await renderer.renderModel({ data: { [MIME_TYPE]: doc(liveId) } } as never);
  Widget.attach(renderer, host);
  return renderer;
}

const tick = () => new Promise((resolve) => setTimeout(resolve, 0));

afterEach(() => {
  document.body.innerHTML = '';
});

describe('a saved copy and its live grid', () => {
  it('hides while the live grid is on the page and shows, with its hint, when it goes', async () => {
    const { copyOut } = outputArea();
    const renderer = await renderCopy(copyOut, 'w1');
    expect(hasCopy('w1')).toBe(true);
    expect(copyOut.style.display).toBe('');
    expect(copyOut.querySelector('.pipatch-saved-hint')?.textContent).toBe(SAVED_COPY_HINT);
    expect(copyOut.querySelector('.pipatch-grid')?.getAttribute('data-status')).toBe('done');

    markLive('w1', true);
    expect(isLive('w1')).toBe(true);
    expect(copyOut.style.display).toBe('none');
    markLive('w2', true); // another grid's liveness changes nothing here
    expect(copyOut.style.display).toBe('none');
    markLive('w1', false);
    expect(copyOut.style.display).toBe('');

    renderer.dispose();
    expect(hasCopy('w1')).toBe(false);
    markLive('w2', false);
  });

  it('starts hidden when its live grid is already there', async () => {
    markLive('w3', true);
    const { copyOut } = outputArea();
    const renderer = await renderCopy(copyOut, 'w3');
    expect(copyOut.style.display).toBe('none');
    renderer.dispose();
    markLive('w3', false);
  });

  it('hides the dead widget output above it, even when it says so later', async () => {
    const { widgetOut, widgetNode, copyOut } = outputArea();
    const renderer = await renderCopy(copyOut, 'w4');
    expect(widgetOut.style.display).toBe('');
    widgetNode.className = 'jupyter-widgets';
    widgetNode.textContent = 'Error displaying widget: model not found';
    await tick();
    expect(widgetOut.style.display).toBe('none');
    renderer.dispose();
  });

  it('steps over the lines the run wrote between the widget and its copy', async () => {
    const { area, widgetOut, widgetNode, copyOut } = outputArea();
    const warning = document.createElement('div');
    warning.className = 'jp-OutputArea-child';
    warning.innerHTML = '<div class="jp-RenderedText" data-mime-type="application/vnd.jupyter.stderr">a warning</div>';
    area.insertBefore(warning, copyOut);
    const renderer = await renderCopy(copyOut, 'w6');
    widgetNode.textContent = 'Error displaying widget: model not found';
    await tick();
    expect(widgetOut.style.display).toBe('none');
    expect(warning.style.display).toBe('');
    renderer.dispose();
  });

  it('leaves a working widget above it alone', async () => {
    const { widgetOut, widgetNode, copyOut } = outputArea();
    widgetNode.innerHTML = '<div class="pipatch-grid">Error displaying widget (a prompt)</div>';
    const renderer = await renderCopy(copyOut, 'w5');
    await tick();
    expect(widgetOut.style.display).toBe('');
    renderer.dispose();
  });

  it('a document without live_id (saved by Result or an older pipatch) shows no hint', async () => {
    const { copyOut } = outputArea();
    const renderer = await renderCopy(copyOut, '');
    expect(copyOut.querySelector('.pipatch-saved-hint')).toBeNull();
    expect(copyOut.style.display).toBe('');
    renderer.dispose();
  });
});
