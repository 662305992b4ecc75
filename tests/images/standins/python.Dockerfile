# A local stand-in for the official python:<x.y.z>-slim-<debian> image, for machines that reach no container
# registry (tests/images/base_images.py builds it only when the real image cannot be pulled). Debian's own
# CPython of the same minor version, laid out as the official image is used: `python` and `pip` on PATH,
# the C headers, and pip allowed to install into the system (Debian marks its Python externally managed,
# PEP 668; the official image's Python is not).
ARG BASE
FROM ${BASE}

ARG PYTHON_MINOR
ENV LANG=C.UTF-8

RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates netbase tzdata \
      "python${PYTHON_MINOR}" "python${PYTHON_MINOR}-dev" python3-pip \
 && rm -rf /var/lib/apt/lists/* \
 && rm -f "/usr/lib/python${PYTHON_MINOR}/EXTERNALLY-MANAGED" \
 && ln -s "/usr/bin/python${PYTHON_MINOR}" /usr/local/bin/python \
 && ln -s "/usr/bin/python${PYTHON_MINOR}" /usr/local/bin/python3 \
 && ln -s /usr/bin/pip3 /usr/local/bin/pip \
 && python -c "import sys; assert '%d.%d' % sys.version_info[:2] == '${PYTHON_MINOR}', sys.version"

CMD ["python3"]
