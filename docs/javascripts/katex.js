// Render the formulas (pymdownx.arithmatex, generic mode) with the bundled KaTeX: no network, works from file://.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    throwOnError: false,
  });
});
