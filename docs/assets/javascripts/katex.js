// Typeset the math pymdownx.arithmatex marks (\( \) inline, \[ \] display) with the site's own KaTeX, on the first
// page and after every instant navigation of mkdocs-material (document$ emits each page).
function typesetMath() {
  for (const element of document.querySelectorAll(".arithmatex")) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  }
}

if (typeof document$ !== "undefined") {
  document$.subscribe(typesetMath);
} else {
  document.addEventListener("DOMContentLoaded", typesetMath);
}
