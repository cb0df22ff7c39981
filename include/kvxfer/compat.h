/* compat.h: every libfabric version difference lives here.
 * kvxfer builds against libfabric 1.17 (Debian 12) through 2.x (Debian 13). Features that
 * an older header lacks compile to a stub that reports -FI_ENOSYS when called, never a build
 * failure (habit 9). */
#ifndef KVXFER_COMPAT_H
#define KVXFER_COMPAT_H

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>

#define KX_FI_BUILD_VERSION FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION)
/* the API version asked of fi_getinfo: what the headers offer, capped at 1.18 semantics we use */
#define KX_FI_API_VERSION KX_FI_BUILD_VERSION

/* dma-buf registration arrived in libfabric 1.20 (struct fi_mr_dmabuf, FI_MR_DMABUF flag) */
#if defined(FI_MR_DMABUF)
#define KX_HAVE_DMABUF 1
#else
#define KX_HAVE_DMABUF 0
#endif

/* libfabric 2.x keeps FI_CONTEXT2 as the context mode; guard the older bit */
#ifndef FI_CONTEXT
#define FI_CONTEXT 0ULL
#endif

#ifndef FI_MR_HMEM
#define FI_MR_HMEM (1 << 10)
#endif

#endif
