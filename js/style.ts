/** Stylesheet for the grid; JupyterLab theme variables with fallbacks for other front ends. */
export const GRID_CSS = `
.pipatch-grid {
  position: relative;
  font-family: var(--jp-ui-font-family, system-ui, sans-serif);
  font-size: var(--jp-ui-font-size1, 13px);
  color: var(--jp-ui-font-color1, #212121);
  background: var(--jp-layout-color0, #ffffff);
  padding: 6px 4px;
  box-sizing: border-box;
  max-width: 100%;
}
.pipatch-header { display: flex; gap: 10px; align-items: baseline; flex-wrap: wrap; }
.pipatch-title { font-weight: 600; font-size: var(--jp-ui-font-size2, 14px); overflow-wrap: anywhere; }
.pipatch-subtitle { color: var(--jp-ui-font-color2, #616161); overflow-wrap: anywhere; }
.pipatch-sides { flex-basis: 100%; color: var(--jp-ui-font-color1, #424242); overflow-wrap: anywhere; font-size: 0.92em; }
.pipatch-toolbar { display: flex; gap: 6px; margin: 6px 0; flex-wrap: wrap; align-items: center; }
.pipatch-toolbar select, .pipatch-toolbar button {
  font: inherit;
  color: var(--jp-ui-font-color1, #212121);
  background: var(--jp-layout-color1, #ffffff);
  border: 1px solid var(--jp-border-color1, #bdbdbd);
  border-radius: 2px;
  padding: 2px 8px;
  cursor: pointer;
}
.pipatch-toolbar button:hover { background: var(--jp-layout-color2, #eeeeee); }
.pipatch-toolbar .pipatch-stop { border-color: var(--jp-error-color1, #d32f2f); color: var(--jp-error-color1, #d32f2f); }
.pipatch-status { color: var(--jp-ui-font-color2, #616161); margin-bottom: 4px; overflow-wrap: anywhere; }
.pipatch-status[data-status="failed"], .pipatch-status[data-status="interrupted"] { color: var(--jp-error-color1, #d32f2f); }
.pipatch-status[data-status="stopped"] { color: var(--jp-warn-color1, #f57c00); }
.pipatch-warnings { margin: 2px 0 6px; padding: 0; list-style: none; color: var(--jp-warn-color0, #e65100); overflow-wrap: anywhere; }
.pipatch-errors { color: var(--jp-error-color1, #d32f2f); }
.pipatch-body { display: flex; align-items: flex-start; }
.pipatch-rowlabels { position: relative; flex: none; overflow: hidden; }
.pipatch-rowlabel {
  position: absolute; right: 4px; left: 0; text-align: right; white-space: pre;
  overflow: hidden; text-overflow: ellipsis; color: var(--jp-ui-font-color1, #212121);
}
.pipatch-scroll { overflow-x: auto; overflow-y: hidden; flex: 1 1 auto; min-width: 0; }
.pipatch-plot { position: relative; }
.pipatch-heatmap, .pipatch-overlay { position: absolute; left: 0; top: 0; image-rendering: pixelated; }
.pipatch-overlay { cursor: crosshair; }
.pipatch-collabels { position: absolute; left: 0; right: 0; overflow: hidden; }
.pipatch-collabel {
  position: absolute; top: 3px; white-space: pre; font-size: 11px; line-height: 13px;
  overflow: hidden; text-overflow: ellipsis; text-align: center; color: var(--jp-ui-font-color1, #212121);
}
.pipatch-collabel.pipatch-rot { transform-origin: 0 0; transform: rotate(90deg); text-align: left; }
.pipatch-collabel.pipatch-subject { font-weight: 700; color: #b2182b; }
.pipatch-legend { display: flex; gap: 6px; align-items: center; flex-wrap: wrap; margin-top: 6px; color: var(--jp-ui-font-color2, #616161); }
.pipatch-bar-wrap { display: inline-flex; gap: 4px; align-items: center; }
.pipatch-colorbar { width: 160px; height: 10px; border: 1px solid var(--jp-border-color2, #e0e0e0); }
.pipatch-swatch { display: inline-block; width: 12px; height: 12px; border: 1px solid var(--jp-border-color1, #bdbdbd); }
.pipatch-swatch-nan { background: rgb(128, 128, 128); }
.pipatch-swatch-pending {
  background: repeating-linear-gradient(45deg, var(--jp-layout-color2, #eeeeee) 0 3px, var(--jp-border-color1, #bdbdbd) 3px 4px);
}
.pipatch-detail { margin-top: 6px; overflow-wrap: anywhere; }
.pipatch-code { position: relative; margin: 4px 0 6px; }
.pipatch-code-text { max-height: 360px; overflow: auto; margin: 0; padding: 6px 8px; font-size: 11px; line-height: 1.35;
  background: var(--jp-layout-color2, #f5f5f5); border: 1px solid var(--jp-border-color2, #e0e0e0); white-space: pre; }
.pipatch-code-copy { position: absolute; top: 4px; right: 16px; font-size: 11px; }
.pipatch-detail-hint { color: var(--jp-ui-font-color2, #616161); font-style: italic; }
.pipatch-saved-hint { color: var(--jp-ui-font-color2, #616161); font-style: italic; font-size: 12px; margin-bottom: 4px; }
.pipatch-detail-error { color: var(--jp-error-color1, #d32f2f); }
.pipatch-top { border-collapse: collapse; margin-top: 4px; }
.pipatch-top th, .pipatch-top td { padding: 1px 8px; text-align: left; border-bottom: 1px solid var(--jp-border-color2, #e0e0e0); }
.pipatch-top-token { font-family: var(--jp-code-font-family, monospace); white-space: pre; }
.pipatch-tooltip {
  position: absolute; z-index: 10; pointer-events: none; max-width: 420px;
  background: var(--jp-layout-color1, #ffffff); color: var(--jp-ui-font-color1, #212121);
  border: 1px solid var(--jp-border-color1, #bdbdbd); box-shadow: 0 1px 4px rgba(0,0,0,0.25);
  padding: 4px 6px; font-size: 12px; white-space: pre-wrap; overflow-wrap: anywhere;
}
.pipatch-circuit-body { display: flex; gap: 12px; align-items: flex-start; flex-wrap: wrap; }
.pipatch-graph { flex: none; background: var(--jp-layout-color0, #ffffff); }
.pipatch-graph text { fill: var(--jp-ui-font-color1, #212121); }
.pipatch-graph .pipatch-rows text, .pipatch-graph text.pipatch-idle { fill: var(--jp-ui-font-color2, #616161); }
.pipatch-edge-hit { pointer-events: stroke; cursor: pointer; }
.pipatch-edge-line { pointer-events: none; }
.pipatch-edge-hover .pipatch-edge-line { stroke-opacity: 1; filter: drop-shadow(0 0 2px rgba(0, 0, 0, 0.7)); }
.pipatch-circuit-side { display: flex; flex-direction: column; gap: 4px; color: var(--jp-ui-font-color2, #616161); font-size: 12px; }
.pipatch-circuit-side .pipatch-bar-wrap { display: flex; }
.pipatch-faithfulness { margin-top: 10px; }
.pipatch-faithfulness-title { font-weight: 600; }
.pipatch-faithfulness-chart { background: var(--jp-layout-color0, #ffffff); }
.pipatch-faithfulness-chart text { fill: var(--jp-ui-font-color2, #616161); }
.pipatch-faithfulness-size { max-width: 260px; overflow-wrap: anywhere; }
.pipatch-top-n-box { display: inline-flex; gap: 6px; align-items: center; }
.pipatch-top-n { width: 180px; }
`;
