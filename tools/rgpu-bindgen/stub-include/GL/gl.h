/* rgpu-bindgen stand-in for <GL/gl.h>: only the types cudaGL.h uses, with the
 * ABI of the Khronos/Mesa header. Used so the generated files do not depend on
 * which OpenGL headers the generating machine has. */
#ifndef RGPU_STUB_GL_H
#define RGPU_STUB_GL_H
typedef unsigned int GLenum;
typedef unsigned int GLuint;
#endif
