#include <cstdio>
__constant__ float coef[4];
__device__ int counter;
template<typename T> __device__ T sq(T x){ return x*x; }
__global__ void vadd(const float*a,const float*b,float*c,int n){int i=blockIdx.x*blockDim.x+threadIdx.x; if(i<n) c[i]=a[i]+b[i]*coef[0];}
__global__ void red(const int*in,int*out,int n){
  __shared__ int s[32];
  int i=blockIdx.x*blockDim.x+threadIdx.x; int v= i<n?in[i]:0;
  for(int o=16;o>0;o>>=1) v+=__shfl_down_sync(0xffffffff,v,o);
  if((threadIdx.x&31)==0) s[threadIdx.x>>5]=v;
  __syncthreads();
  if(threadIdx.x<32){ v = threadIdx.x < blockDim.x/32 ? s[threadIdx.x]:0; for(int o=16;o>0;o>>=1) v+=__shfl_down_sync(0xffffffff,v,o); if(threadIdx.x==0) atomicAdd(out,v);}
}
__global__ void misc(double*d, unsigned*u, float*f){
  extern __shared__ float dyn[];
  int t=threadIdx.x; dyn[t]=f[t]; __syncthreads();
  unsigned b=__ballot_sync(0xffffffff, t&1); u[t]=b+__popc(t)+__clz(t)+__brev(t); 
  f[t]=sqrtf(dyn[(t+1)%blockDim.x])+__expf(f[t])+sinf(f[t])+tanhf(f[t]) + sq(f[t]);
  d[t]=sqrt((double)t)/3.0 + sq((double)t);
  if(t==0) printf("hello %d %f %s\n", t, 1.5, "x");
  long long c=clock64(); if(c<0) u[0]=0;
  atomicMax(&counter, t); atomicCAS(u, 0, 1);
}
